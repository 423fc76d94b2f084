"""A prefill or decode instance started with a bad configuration exits at once with status 2
and one line naming the option — before loading any weights or binding a port."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
BAD_CONFIGURATIONS = [
    (["--role", "prefill", "--model", "nosuch"], "--model: unknown model preset 'nosuch'"),
    (["--role", "prefill", "--model", "/nonexistent/ckpt"], "checkpoint directory '/nonexistent/ckpt' does not exist"),
    (["--role", "prefill", "--model", "tiny", "--pipeline-group", "99"], "--pipeline-group 99 exceeds the model's 4 layers"),
    (["--role", "decode", "--model", "nosuch"], "--model: unknown model preset 'nosuch'"),
    (["--role", "decode", "--model", "tiny", "--port", "99999"], "--port out of range: 99999"),
    (["--role", "decode", "--model", "tiny", "--num-blocks", "0"], "--num-blocks"),
    (["--role", "store", "--host", "0.0.0.0"], "no address a peer can dial: set --advertise-host"),
    (["--role", "prefill", "--model", "tiny", "--host", "::"], "no address a peer can dial: set --advertise-host"),
    (["--role", "decode", "--model", "tiny", "--advertise-host", "0.0.0.0"], "--advertise-host must be an address"),
    (["--role", "store", "--host", "[::]"], "no address a peer can dial"),
    (["--role", "store", "--advertise-host", " 10.0.0.7"], "--advertise-host must be an address"),
]


@pytest.fixture(scope="module")
def exits() -> dict[tuple[str, ...], tuple[int, str]]:
    """Every bad configuration started at once, each its own process: most import torch before
    they refuse (~3 s of CPU each), so one after another they were ~30 s of the suite on one
    core; together they use both. Each case's exit status and stderr, by its arguments."""
    procs = {tuple(args): subprocess.Popen([sys.executable, "-m", "mooncake_lite", *args], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True) for args, _ in BAD_CONFIGURATIONS}
    exits = {}
    try:
        for args, proc in procs.items():
            stderr = proc.communicate(timeout=90)[1]
            exits[args] = (proc.returncode, stderr)
        return exits
    finally:
        for proc in procs.values():
            proc.kill()


@pytest.mark.parametrize("args, message", BAD_CONFIGURATIONS)
def test_bad_role_configuration_exits_with_a_clear_error(exits, args, message):
    returncode, stderr = exits[tuple(args)]
    assert returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"mooncake --role {args[1]}: error: ") and message in last


def test_a_conductor_may_bind_every_interface_and_others_may_with_an_advertised_host():
    # Checked in process: nothing is bound. Peers reach the conductor by its configured URL.
    from mooncake_lite.common.config import load_config
    from mooncake_lite.conductor.config import Config as ConductorConfig
    from mooncake_lite.store.config import Config as StoreConfig
    assert load_config(ConductorConfig, ["--host", "0.0.0.0"], prog="t", section="conductor").host == "0.0.0.0"
    cfg = load_config(StoreConfig, ["--host", "0.0.0.0", "--advertise-host", "10.0.0.7"], prog="t", section="store")
    assert cfg.peer_host == "10.0.0.7"


@pytest.mark.parametrize("flag", ["--port", "--data-port"])
def test_a_port_in_use_is_one_line_and_exit_2(flag):
    """A first user's `mooncake up` beside another server on 8000 met a 30-line traceback per role."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"--port": "0", "--data-port": "0", flag: str(port)}
        proc = subprocess.run([sys.executable, "-m", "mooncake_lite", "--role", "store", *[x for kv in ports.items()
                               for x in kv], "--dram", "64MiB"], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"mooncake --role store: error: cannot listen on 127.0.0.1:{port}: "
                                                    f"Address already in use (--host, {flag})")
