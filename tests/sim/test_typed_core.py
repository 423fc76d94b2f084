"""The compiled simulator's guards (sim/compiled.py, docs/sim.md "A compiled core, shipped").

mypyc trusts annotations, so the modules it compiles must type-check with no errors; and a
compiled run must make the decisions and results of the pure one. The first runs mypy (skipped
without it); the second needs a build (~1 min), so it runs when one for this source is already in
the cache, or when MOONCAKE_TEST_COMPILED=1 asks for it, and is skipped otherwise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lite.sim import compiled
from mooncake_lite.sim.cli import main as sim_main

ROOT = compiled.package_root()
HAS_MYPY = importlib.util.find_spec("mypy") is not None
needs_mypy = pytest.mark.skipif(not HAS_MYPY, reason="mypy is not installed (pip install 'mooncake-lite[test]')")


def test_the_list_names_existing_modules_once():
    assert len(set(compiled.MODULES)) == len(compiled.MODULES)
    for path in compiled.module_paths(ROOT):
        assert Path(path).is_file(), path
    # left out on purpose (compiled.py says why): interpreted subclasses or builtin subclasses
    for name in ("mooncake_lite.sim.driver", "mooncake_lite.sim.tenants", "mooncake_lite.sim.oracle"):
        assert name not in compiled.MODULES


def test_no_type_errors_silenced_in_compiled_modules():
    # mypyc compiles what the annotations say: a silenced error is code it may compile wrongly
    # (a float in an ``int`` gave wrong arithmetic in the first experiment: docs/sim.md)
    for path in compiled.module_paths(ROOT):
        text = Path(path).read_text()
        assert "type: ignore" not in text and "# mypy:" not in text, path


@needs_mypy
def test_compiled_modules_type_check_clean(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mypy", *compiled.module_paths(), *compiled.MYPY_FLAGS,
                           f"--cache-dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


@needs_mypy
def test_build_key_follows_every_source_file(tmp_path):
    pkg = tmp_path / "mooncake_lite"
    (pkg / "sim").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sim" / "a.py").write_text("x = 1\n")
    before = compiled.build_key(tmp_path)
    (pkg / "sim" / "__pycache__").mkdir()
    (pkg / "sim" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    assert compiled.build_key(tmp_path) == before          # caches do not count
    (pkg / "sim" / "a.py").write_text("x = 2\n")
    assert compiled.build_key(tmp_path) != before          # an edit is another build


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(compiled.shutil, "which", lambda _: None)
    with pytest.raises(compiled.CompiledBuildError, match="C compiler"):
        compiled._check_compiler()


def test_pure_process_is_not_taken_for_the_build(tmp_path):
    problems = compiled.check_running(tmp_path)
    assert any("imported from" in p for p in problems)
    assert any("is not compiled" in p for p in problems)


def test_tenants_refused_compiled(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}\n')
    assert sim_main([str(trace), "--tenants", str(tmp_path / "x.toml"), "--compiled"]) == 2
    assert "--compiled does not run --tenants" in capsys.readouterr().err


# The run both ways: every Decision and RequestResult repr, hashed in order after the run (a
# compiled caller appends to a list without a subclass's append override).
_DIGEST = """
import hashlib, sys
from itertools import islice
import mooncake_lite.sim.cluster as C
from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import get_hardware
from mooncake_lite.trace.synth import SynthConfig, iter_synthesize
hw = get_hardware("llama2-70b-a800")
alt = sys.argv[1] == "alt"
sched = SchedulerConfig(admission="predictive" if alt else "early", ttft_slo_s=30.0, tbt_slo_s=0.1,
                        block_size=hw.block_size)
extra = dict(predict_output=True, max_tokens_policy="cap:4096", eviction="length-aware",
             store_blocks_per_node=600, ssd_blocks_per_node=3000) if alt else {}
sim = MooncakeSim(SimConfig(num_prefill=16, num_decode=12 if alt else 16, hardware="llama2-70b-a800",
                            scheduler=sched, **extra), hw)
decisions = sim.decisions = []
results = []
sim.recorder.sink = lambda r: results.append(repr(r))
res = sim.run(islice(iter_synthesize(SynthConfig(num_requests=2000, rate_per_s=20.0 if alt else 10.0)), 2000))
h = hashlib.sha256()
for d in decisions:
    h.update(repr(d).encode())
for r in results:
    h.update(r.encode())
print(C.__file__, len(decisions), len(results), res.counters["rejected"], h.hexdigest())
"""


def _digest(pkg_root: Path, variant: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(pkg_root))
    out = subprocess.run([sys.executable, "-P", "-c", _DIGEST, variant], env=env, capture_output=True,
                         text=True, timeout=240, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def _build_or_skip() -> Path:
    if not HAS_MYPY:
        pytest.skip("mypy is not installed")
    key = compiled.build_key()
    build = compiled.cache_dir() / key
    if not (build / compiled.READY).exists() and os.environ.get("MOONCAKE_TEST_COMPILED") != "1":
        pytest.skip("no compiled build of this source in the cache (MOONCAKE_TEST_COMPILED=1 builds one)")
    return compiled.ensure_built()


@pytest.mark.parametrize("variant", ["scale", "alt"])
def test_compiled_run_decides_as_the_pure_one(variant):
    build = _build_or_skip()
    pure, comp = _digest(ROOT, variant), _digest(build, variant)
    assert pure[0].endswith(".py") and comp[0].endswith(compiled.sysconfig.get_config_var("EXT_SUFFIX"))
    assert comp[0].startswith(str(build))
    assert int(pure[1]) == 2000 and int(pure[2]) == 2000
    assert comp[1:] == pure[1:]


@needs_mypy
def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MOONCAKE_CACHE", str(blocker))    # a file where the cache's directory goes
    monkeypatch.delenv(compiled.ENV_RUN, raising=False)
    monkeypatch.setattr(compiled, "_check_compiler", lambda: None)
    with pytest.raises(compiled.CompiledBuildError, match="MOONCAKE_CACHE"):
        compiled.use_compiled(["sim", "run", "x"])


def test_old_builds_are_pruned(tmp_path):
    for i in range(6):
        build = tmp_path / f"k{i}"
        build.mkdir()
        (build / compiled.READY).write_text("")
        os.utime(build / compiled.READY, (1000 + i, 1000 + i))
    (tmp_path / "k5.tmp-1").mkdir()                    # a build under way is not touched
    compiled._prune(tmp_path, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k2", "k3", "k4", "k5", "k5.tmp-1"]
