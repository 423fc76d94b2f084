"""Packages depend only downward, and no modules import each other in a cycle.

Every import in ``mooncake_lite/`` and ``kernels/`` is read with ``ast`` (function-local ones
included) and mapped to its package; a package may import only packages on a lower layer of
``LAYERS``. Packages on one layer are peers and import nothing from each other: prefill, decode
and the conductor talk over the network, never through each other's modules. Imports that run
when a module is imported (module level, not under ``if TYPE_CHECKING:``) must form no cycle.
Imports by name string (``importlib``: cli.py, cluster/registration.py) are not seen here.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.fakes import write_tree

ROOT = Path(__file__).resolve().parents[1]
# Each top-level import package and the folder it lives in: ``kernels/`` installs as
# ``mooncake_kernels`` (a top-level ``kernels`` is Hugging Face's package, which transformers needs).
FOLDERS = {"mooncake_lite": "mooncake_lite", "mooncake_kernels": "kernels"}
TOP = tuple(FOLDERS)

# Lowest first.
LAYERS: tuple[frozenset[str], ...] = tuple(map(frozenset, (
    {"common", "kernels", "trace"},         # config, protocol, hashing; GPU kernels; trace files
    {"transfer", "model", "scheduler"},     # framing and the KV stream; the torch model; pure scheduling
    {"store", "instance"},                  # the block pool and its client; what prefill and decode share
    {"prefill", "decode", "conductor"},     # the roles that serve requests
    {"sim", "cluster"},                     # the simulator; ``mooncake up``
    {"bench"},
    {"mooncake_lite"},                      # the executable: cli.py, __main__.py
)))
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


@dataclass(frozen=True)
class Import:
    module: str        # the importing module, e.g. mooncake_lite.prefill.app
    target: str        # the imported module, e.g. mooncake_lite.transfer.kv_stream
    line: int
    at_import: bool    # runs when ``module`` is imported (module level, not TYPE_CHECKING)


def module_name(path: Path, root: Path) -> str:
    folder, *rest = path.relative_to(root).with_suffix("").parts
    parts = [next(pkg for pkg, f in FOLDERS.items() if f == folder), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """``kernels`` for mooncake_kernels.*, X for mooncake_lite.X.*, ``mooncake_lite`` for its own modules."""
    parts = module.split(".")
    if parts[0] == "mooncake_kernels":
        return "kernels"
    if len(parts) == 1:
        return parts[0]
    return parts[1] if parts[1] not in ("cli", "__main__") else "mooncake_lite"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(tree: ast.Module, module: str, is_package: bool, modules: set[str]) -> Iterable[Import]:
    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            anchor = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        # ``from pkg import sub`` imports the module pkg.sub when there is one
        return list(dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                                  for a in node.names))

    def walk(node: ast.AST, at_import: bool) -> Iterable[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target.split(".")[0] in TOP:
                        yield Import(module, target, child.lineno, at_import)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), at_import)
            else:
                yield from walk(child, at_import)

    return walk(tree, True)


def scan(root: Path) -> list[Import]:
    """Every import between the modules of ``TOP`` packages under ``root``."""
    paths = sorted(p for top in TOP for p in (root / FOLDERS[top]).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    found: list[Import] = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        found += _imports_of(tree, module_name(path, root), path.name == "__init__.py", modules)
    return found


def upward_imports(imports: Iterable[Import]) -> list[str]:
    """Each import of a package on the same or a higher layer, or of a package with no layer."""
    bad = []
    for imp in imports:
        src, dst = package_of(imp.module), package_of(imp.target)
        if src == dst:
            continue
        if src not in LAYER_OF or dst not in LAYER_OF:
            bad.append(f"{imp.module}:{imp.line}: package {(src if src not in LAYER_OF else dst)!r} has no layer")
        elif LAYER_OF[dst] >= LAYER_OF[src]:
            bad.append(f"{imp.module}:{imp.line} imports {imp.target}: {src} (layer {LAYER_OF[src]}) may not "
                       f"import {dst} (layer {LAYER_OF[dst]})")
    return bad


def import_cycles(imports: Iterable[Import]) -> list[list[str]]:
    """The strongly connected components (more than one module, or a module importing itself)
    of the graph of imports that run at import time (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.at_import:
            graph.setdefault(imp.module, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


# ---- the code base ---------------------------------------------------------------------------

@functools.cache
def codebase() -> tuple[Import, ...]:
    return tuple(scan(ROOT))


def test_every_package_has_a_layer():
    found = {package_of(module_name(p, ROOT)) for top in TOP for p in (ROOT / FOLDERS[top]).rglob("*.py")}
    assert found - set(LAYER_OF) == set(), "place each new package on a layer of LAYERS"


def test_packages_import_only_packages_below_them():
    assert upward_imports(codebase()) == []


def test_no_import_cycle_between_modules():
    assert import_cycles(codebase()) == []


# ---- the checks themselves catch what they should ---------------------------------------------

def test_an_upward_or_sideways_import_is_caught_even_inside_a_function(tmp_path):
    write_tree(tmp_path, {
        "mooncake_lite/__init__.py": "",
        "mooncake_lite/store/__init__.py": "",
        "mooncake_lite/store/app.py": "def f():\n    from mooncake_lite.prefill.app import g\n",
        "mooncake_lite/decode/__init__.py": "from mooncake_lite.prefill import engine\n",
        "mooncake_lite/prefill/__init__.py": "",
        "mooncake_lite/prefill/engine.py": "import mooncake_lite.common.protocol\nimport torch\n",
        "mooncake_lite/prefill/app.py": "",
        "kernels/__init__.py": "",
    })
    bad = upward_imports(scan(tmp_path))
    assert len(bad) == 2
    assert bad[0].startswith("mooncake_lite.decode:1 imports mooncake_lite.prefill.engine: decode (layer 3)")
    assert bad[1].startswith("mooncake_lite.store.app:2 imports mooncake_lite.prefill.app: store (layer 2)")


def test_a_package_without_a_layer_is_caught():
    imports = [Import("mooncake_lite.gadgets.x", "mooncake_lite.common.config", 3, True)]
    assert upward_imports(imports) == ["mooncake_lite.gadgets.x:3: package 'gadgets' has no layer"]


def test_a_cycle_at_import_time_is_caught_and_a_deferred_or_type_only_import_is_not(tmp_path):
    write_tree(tmp_path, {
        "mooncake_lite/__init__.py": "",
        "mooncake_lite/prefill/__init__.py": "",
        "mooncake_lite/prefill/a.py": "from mooncake_lite.prefill.b import x\n",
        "mooncake_lite/prefill/b.py": "if True:\n    from mooncake_lite.prefill import c\n",
        "mooncake_lite/prefill/c.py": "import mooncake_lite.prefill.a\n",
        "mooncake_lite/prefill/d.py": "from typing import TYPE_CHECKING\nimport mooncake_lite.prefill.e\n"
                                     "if TYPE_CHECKING:\n    import mooncake_lite.prefill.a\n",
        "mooncake_lite/prefill/e.py": "def f():\n    import mooncake_lite.prefill.d\n",
        "kernels/__init__.py": "",
    })
    assert import_cycles(scan(tmp_path)) == [["mooncake_lite.prefill.a", "mooncake_lite.prefill.b",
                                              "mooncake_lite.prefill.c"]]
