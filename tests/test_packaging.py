"""Packaging: installing the project beside a node's own CUDA torch keeps that torch (pyproject.toml
sets a floor, the exact CPU wheel is bin/_env.sh's choice), and its top-level names are its own."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return req


def test_torch_is_a_floor_that_cuda_builds_meet():
    spec = torch_requirement().specifier
    assert all(s.operator in (">=", ">") for s in spec), f"torch must be a floor, not {spec}"
    # pip keeps an installed torch that the specifier contains: CUDA builds carry local versions.
    for version in ("2.5.1+cu124", "2.7.0+cu128", "2.13.0+cu130", "2.13.0+cpu", torch.__version__):
        assert spec.contains(Version(version), prereleases=True), version
    assert not spec.contains("2.4.1+cu121")


def test_env_script_pins_the_cpu_wheel_within_the_floor():
    text = (ROOT / "bin" / "_env.sh").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("TORCH_CPU=")]
    pin = Requirement(line.split("=", 1)[1].split()[0].strip('"'))
    assert [s.operator for s in pin.specifier] == ["=="]
    assert torch_requirement().specifier.contains(next(iter(pin.specifier)).version)


def _fake_venv(tmp_path: Path, has_torch: bool) -> tuple[Path, Path]:
    """A venv whose python logs every call; ``import torch`` succeeds when ``has_torch``."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                      f'[ "$1 $2" = "-c import torch" ] && exit {0 if has_torch else 1}\nexit 0\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return venv, log


@pytest.mark.parametrize("has_torch", [True, False])
def test_env_script_keeps_a_torch_the_venv_has(tmp_path, has_torch):
    venv, log = _fake_venv(tmp_path, has_torch)
    env = {**os.environ, "MOONCAKE_VENV": str(venv)}
    env.pop("MOONCAKE_TORCH", None)
    subprocess.run(["bash", "-c", f"source {ROOT}/bin/_env.sh"], env=env, check=True, timeout=60)
    calls = log.read_text().splitlines()
    torch_installs = [c for c in calls if c.startswith("-m pip install") and "torch==" in c]
    assert torch_installs == ([] if has_torch else ["-m pip install -q torch==2.13.0"])
    assert any(c.startswith("-m pip install -q -e ") and c.endswith("[test]") for c in calls)


def test_the_kernels_install_under_a_name_no_other_distribution_owns():
    """``kernels/`` installs as ``mooncake_kernels``: Hugging Face's ``kernels`` (which transformers
    5.25 requires) owns the top-level name, and two distributions writing one package directory
    break each other."""
    from importlib.metadata import distribution

    top_level = set(distribution("mooncake-lite").read_text("top_level.txt").split())
    assert top_level == {"mooncake_lite", "mooncake_kernels"}


def test_the_model_imports_beside_a_foreign_kernels_package(tmp_path):
    # A package named ``kernels`` first on the path, as Hugging Face's is in a transformers venv,
    # and the working directory away from the checkout (whose own folder would shadow it).
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("FOREIGN = True\n")
    code = ("import kernels, mooncake_lite.model.llama, mooncake_kernels.attention\n"
            "assert kernels.FOREIGN\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
