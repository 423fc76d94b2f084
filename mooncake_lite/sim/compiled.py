"""An opt-in compiled build of the simulator's hot modules (``--compiled``; docs/sim.md, Scale).

mypyc compiles :data:`MODULES` of a full copy of the package into a cache directory keyed by a
hash of every file of the package, the Python ABI and the mypy version, so a compiled module
and an edited source never mix: any edit is another key and another build. A command given
``--compiled`` builds once (a lock keeps two concurrent builds from racing), then re-executes
itself with that directory first on ``sys.path`` and checks, before it runs, that the package
and every module of the list were loaded from there. Pure Python stays the default and what
the tests run; the compiled run must make the same decisions (tests/sim/test_typed_core.py).

mypyc trusts annotations: a float in an ``int`` field is a ``TypeError`` or, where a check is
off, wrong arithmetic. So the list must type-check with no errors (the guard test runs mypy
over it), and a fix must be a real annotation or narrowing, never an ignore.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


# The modules compiled: what one simulated request runs through (the decision core, the stores,
# decode batches, the event loop, the trace reader). The one list: the build and the guard test
# read it. Left out on purpose: sim/driver.py (ColocatedSim, an interpreted subclass, derives
# from it); sim/tenants.py (TenantSim subclasses MooncakeSim: ``--tenants`` is refused);
# sim/oracle.py (a builtin exception's subclass).
MODULES = (
    "mooncake_lite.common.tbt",
    "mooncake_lite.trace.format",
    "mooncake_lite.store.eviction",
    "mooncake_lite.scheduler.wide",
    "mooncake_lite.scheduler.wide_decode",
    "mooncake_lite.scheduler.view",
    "mooncake_lite.scheduler.prefill_view",
    "mooncake_lite.scheduler.snapshot",
    "mooncake_lite.scheduler.cache",
    "mooncake_lite.scheduler.estimate",
    "mooncake_lite.scheduler.costs",
    "mooncake_lite.scheduler.block_index",
    "mooncake_lite.scheduler.scheduler",
    "mooncake_lite.scheduler.prefill_select",
    "mooncake_lite.scheduler.rules",
    "mooncake_lite.scheduler.admission",
    "mooncake_lite.scheduler.state",
    "mooncake_lite.scheduler.queue_order",
    "mooncake_lite.scheduler.packing",
    "mooncake_lite.scheduler.decision",
    "mooncake_lite.scheduler.predict",
    "mooncake_lite.scheduler.prediction_accuracy",
    "mooncake_lite.sim.cluster",
    "mooncake_lite.sim.nodes",
    "mooncake_lite.sim.batch",
    "mooncake_lite.sim.events",
    "mooncake_lite.sim.request",
    "mooncake_lite.sim.metrics",
    "mooncake_lite.sim.recorder",
    "mooncake_lite.sim.store",
    "mooncake_lite.sim.costs",
)
# mypy's flags for the list, the same for the guard test and the build: imports outside the
# list are read for their types but not reported on (they are not compiled).
MYPY_FLAGS = ("--follow-imports=silent", "--ignore-missing-imports")
# Set in the re-executed process: the build directory it must run from.
ENV_RUN = "MOONCAKE_COMPILED_DIR"
READY = "BUILD-OK"
# Builds kept in the cache (the newest; each ~6 MB): every edit of the package is a new key.
KEEP_BUILDS = 4
# The re-executed command: -P keeps the current directory off sys.path (run from a checkout, it
# would import that tree's pure modules before the build's).
_REEXEC = "import sys; from mooncake_lite.cli import main; sys.exit(main())"


class CompiledBuildError(RuntimeError):
    """The compiled build cannot be made or used here (the message says why and what to do)."""


def module_paths(root: Path | None = None) -> list[str]:
    """:data:`MODULES` as source paths relative to ``root`` (the directory holding the package)."""
    paths = [m.replace(".", "/") + ".py" for m in MODULES]
    return paths if root is None else [str(root / p) for p in paths]


def package_root() -> Path:
    """The directory holding the ``mooncake_lite`` package this process imported (imported
    before any of its modules; not imported here by name: it is the top of the layering)."""
    return Path(sys.modules["mooncake_lite"].__file__ or "").resolve().parent.parent


def cache_dir() -> Path:
    base = os.environ.get("MOONCAKE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mooncake-lite")
    return Path(base) / "compiled"


def mypy_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        raise CompiledBuildError("the compiled build needs mypy (with mypyc): "
                                 "pip install 'mooncake-lite[compiled]'") from None
    return __version__


def _source_files(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".pyc", ".so"))


def build_key(root: Path | None = None) -> str:
    """Hash of every file of the package under ``root``, the Python ABI and the mypy version."""
    root = root or package_root()
    h = hashlib.sha256()
    for tag in (sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", mypy_version(), ",".join(MODULES)):
        h.update(tag.encode() + b"\0")
    pkg = root / "mooncake_lite"
    for path in _source_files(pkg):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def _check_compiler() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        raise CompiledBuildError(f"the compiled build needs a C compiler ({cc!r}, as Python was built with) on PATH")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        raise CompiledBuildError(f"the compiled build needs Python's headers ({header} is missing: "
                                 "install the python3-dev package of this Python)")


def _compile(src_root: Path, out: Path) -> None:
    """A full copy of the package at ``out``, with :data:`MODULES` compiled in place."""
    shutil.copytree(src_root / "mooncake_lite", out / "mooncake_lite",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    cmd = [sys.executable, "-m", "mypyc", *module_paths(), *MYPY_FLAGS]
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise CompiledBuildError(f"mypyc failed (exit {proc.returncode}):\n{tail}")
    shutil.rmtree(out / "build", ignore_errors=True)       # the C sources and objects: ~40 MB
    shutil.rmtree(out / ".mypy_cache", ignore_errors=True)


def ensure_built(src_root: Path | None = None, log=sys.stderr) -> Path:
    """The build directory for the package under ``src_root`` (default: this one), compiled
    first if no finished build of its key is in the cache."""
    src_root = src_root or package_root()
    key = build_key(src_root)
    _check_compiler()
    base = cache_dir()
    target = base / key
    if (target / READY).exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # a second build of the key waits for the first
        if (target / READY).exists():
            return target
        log.write(f"mooncake: compiling {len(MODULES)} modules with mypyc into {target} (once for this "
                  "source; about a minute or two)\n")
        log.flush()
        t0 = time.perf_counter()
        tmp = base / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _compile(src_root, tmp)
            (tmp / READY).write_text(f"key {key}\nmypy {mypy_version()}\npython {sys.version.split()[0]}\n")
            shutil.rmtree(target, ignore_errors=True)    # an unfinished build left by a crash
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.write(f"mooncake: compiled build ready in {time.perf_counter() - t0:.0f} s\n")
        log.flush()
        _prune(base, keep=KEEP_BUILDS)
    return target


def _prune(base: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest finished builds (a process still running from an older
    one keeps what it has loaded: the files are only unlinked)."""
    builds = sorted((p for p in base.iterdir() if (p / READY).exists()), key=lambda p: (p / READY).stat().st_mtime)
    for old in builds[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
        (base / f"{old.name}.lock").unlink(missing_ok=True)


def check_running(build: Path) -> list[str]:
    """In the re-executed process: the package and every compiled module came from ``build``
    (problems, empty if none)."""
    problems = []
    if package_root() != build.resolve():
        problems.append(f"mooncake_lite was imported from {package_root()}, not {build}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for name in MODULES:
        path = getattr(importlib.import_module(name), "__file__", None) or ""
        if not path.endswith(suffix):
            problems.append(f"{name} is not compiled ({path})")
    return problems


def use_compiled(cli_argv: list[str], log=sys.stderr) -> None:
    """For a command given ``--compiled``: in the re-executed process, check that it runs the
    build and return; otherwise build (once) and re-execute ``mooncake *cli_argv`` on it
    (does not return). Raises :class:`CompiledBuildError` with what to do."""
    running = os.environ.get(ENV_RUN)
    if running:
        problems = check_running(Path(running))
        if problems:
            raise CompiledBuildError("the compiled run is not on its build: " + "; ".join(problems))
        log.write(f"mooncake: running compiled ({len(MODULES)} modules) from {package_root()}\n")
        log.flush()
        return
    try:
        build = ensure_built()
    except OSError as exc:   # the cache not writable, the disk full, ...
        raise CompiledBuildError(f"the compiled build failed in {cache_dir()} ({exc}); "
                                 "MOONCAKE_CACHE names another place") from exc
    env = dict(os.environ)
    env[ENV_RUN] = str(build)
    env["PYTHONPATH"] = os.pathsep.join([str(build), *filter(None, [env.get("PYTHONPATH")])])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-P", "-c", _REEXEC, *cli_argv], env)


def run_on_build(prog: str, cli_argv: list[str], refusal: str | None = None) -> bool:
    """What a command given ``--compiled`` calls first: :func:`use_compiled` (does not return
    until it runs on the build); False, with ``<prog>: error: ...`` on stderr, where the
    build cannot be made or used, or where ``refusal`` says why this command cannot run compiled."""
    try:
        if refusal is not None:
            raise CompiledBuildError(refusal)
        use_compiled(cli_argv)
    except CompiledBuildError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return False
    return True
