"""bin/arch-metrics finds what it measures, on small synthetic trees (not this repository)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from tests.fakes import write_tree

SCRIPT = Path(__file__).resolve().parents[1] / "bin" / "arch-metrics"


def _load():
    loader = importlib.machinery.SourceFileLoader("arch_metrics", str(SCRIPT))
    spec = importlib.util.spec_from_loader("arch_metrics", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["arch_metrics"] = module  # dataclasses look their module up
    loader.exec_module(module)
    return module


am = _load()


def test_a_circle_is_found_through_a_relative_type_only_import_inside_a_function(tmp_path):
    write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from .c import g\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n",
        "pkg/d.py": "import pkg.a\n",
    })
    graph = am.import_graph(am.source_files(tmp_path / "pkg"), tmp_path)
    assert am.import_circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_no_circle_in_a_tree_that_imports_downward(tmp_path):
    write_tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "import os\n"})
    assert am.import_circles(am.import_graph(am.source_files(tmp_path / "pkg"), tmp_path)) == []


def _body(names: tuple[str, ...], value: str) -> str:
    return "".join(f"    {n} = compute({n}, {value}) + 1\n" for n in names)


def test_a_same_shape_pair_is_found_with_other_names_and_values(tmp_path):
    first = "def one(a, b):\n    # a comment\n\n" + _body(("a", "b", "c", "d", "e", "f", "g"), "7")
    second = "import os\n\ndef two(p, q):\n" + _body(("p", "q", "r", "s", "t", "u", "v"), "42")
    write_tree(tmp_path, {"pkg/one.py": first, "pkg/two.py": second, "pkg/three.py": _body(("a",) * 3, "1")})
    pairs = am.same_shape_pairs(am.source_files(tmp_path / "pkg"), tmp_path)
    assert [(p.a, p.b, p.lines) for p in pairs] == [("pkg/one.py:1-10", "pkg/two.py:3-10", 8)]


def test_five_shared_lines_or_a_shape_in_more_than_eight_places_make_no_pair(tmp_path):
    names = ("a", "b", "c", "d", "e", "f")
    files = {f"pkg/m{i}.py": "def f():\n" + _body(names, str(i)) for i in range(9)}
    files["pkg/short1.py"] = "def f():\n" + _body(("x", "y", "z", "w"), "0") + "    return 1\n"
    files["pkg/short2.py"] = "def g():\n" + _body(("x", "y", "z", "w"), "0") + "    pass\n"
    write_tree(tmp_path, files)
    assert am.same_shape_pairs(am.source_files(tmp_path / "pkg"), tmp_path) == []


def test_a_41_line_function_and_a_401_line_file_are_counted(tmp_path):
    long_fn = "async def long():\n" + "    x = 1\n" * 40          # 41 lines
    short_fn = "def short():\n" + "    x = 1\n" * 39          # 40 lines
    nested = "def outer():\n    def inner():\n" + "        y = 2\n" * 40
    write_tree(tmp_path, {"pkg/f.py": long_fn + short_fn + nested, "pkg/big.py": "x = 1\n" * 401,
                     "pkg/ok.py": "x = 1\n" * 400})
    paths = am.source_files(tmp_path / "pkg")
    found = {(s.where, s.name, s.lines) for s in am.long_functions(paths, tmp_path)}
    assert found == {("pkg/f.py:1", "long", 41), ("pkg/f.py:82", "outer", 42),
                     ("pkg/f.py:83", "inner", 41)}
    assert [(s.where, s.lines) for s in am.long_files(paths, tmp_path)] == [("pkg/big.py", 401)]


def test_docs_under_results_do_not_count(tmp_path):
    write_tree(tmp_path, {"docs/a.md": "l\n" * 3, "docs/results/2026.md": "l\n" * 50, "docs/x.toml": "a\n"})
    report = am.Report(doc_pages=am.doc_pages(tmp_path / "docs"))
    assert report.doc_pages == {"docs/a.md": 3} and report.figures()["doc_lines"] == 3


def test_the_script_reports_and_exits_0(tmp_path, capsys):
    write_tree(tmp_path, {"mooncake_lite/__init__.py": "", "docs/a.md": "x\n"})
    assert am.main(["--root", str(tmp_path), "--json"]) == 0
    assert '"doc_lines": 1' in capsys.readouterr().out


def test_a_stretch_of_one_shape_is_one_place_and_no_pair_with_itself(tmp_path):
    enum = "class Op:\n" + "".join(f"    NAME{i} = {i}\n" for i in range(20))
    write_tree(tmp_path, {"pkg/ops.py": enum})
    assert am.same_shape_pairs(am.source_files(tmp_path / "pkg"), tmp_path) == []


def test_docstrings_and_literal_data_make_no_pair_but_code_with_fstrings_does(tmp_path):
    doc = '"""A module.\n\nIt says\nwhat it does\nover seven\nlines of prose.\n"""\n'
    names = "NAMES = (\n" + "".join(f'    "mod.name{i}",\n' for i in range(8)) + ")\n"
    fn_doc = 'def f():\n    """One\n    two\n    three\n    four\n    five\n    six."""\n    return 1\n'
    write_tree(tmp_path, {"pkg/a.py": doc + names + fn_doc, "pkg/b.py": doc + names + fn_doc})
    assert am.same_shape_pairs(am.source_files(tmp_path / "pkg"), tmp_path) == []
    report = "def r(s):\n    return (\n" + "".join(f'        f"v{i} {{s.x{i}}}"\n' for i in range(7)) + "    )\n"
    write_tree(tmp_path, {"pkg/c.py": report, "pkg/d.py": report.replace("def r(s)", "def q(s)")})
    pairs = am.same_shape_pairs(am.source_files(tmp_path / "pkg"), tmp_path)
    assert [(p.a, p.b) for p in pairs] == [("pkg/c.py:1-9", "pkg/d.py:1-9")]



def test_field_declarations_and_self_x_equals_x_are_no_shape_and_end_a_run(tmp_path):
    fields = "".join(f"    f{i}: int = 0\n" for i in range(8))
    init = "    def __init__(self, a, b, c, d, e, f):\n" + "".join(f"        self.{n} = {n}\n" for n in "abcdef")
    logic = "def g(self, x):\n    a = x + 1\n    b = a * 2\n    c = b - 3\n    self.x = x\n" \
        "    d = c + 4\n    e = d * 5\n    return e\n"   # 4 lines, a declaration, 3 lines
    write_tree(tmp_path, {f"pkg/{name}.py": f"@dataclass\nclass {name.upper()}:\n" + fields + init + logic
                          for name in ("a", "b")})
    paths = am.source_files(tmp_path / "pkg")
    assert am.same_shape_pairs(paths, tmp_path) == []
    pairs = am.same_shape_pairs(paths, tmp_path, declarations=True)   # the definition before
    assert [(p.a, p.b, p.lines) for p in pairs] == [("pkg/a.py:1-25", "pkg/b.py:1-25", 25)]
