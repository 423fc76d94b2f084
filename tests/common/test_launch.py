"""The one way to start a role process: ready line, output relay, failures explained, stop for sure.

Small stand-in commands (``python -c``) play the role: they print what a role prints.
"""

import signal
import sys

import pytest

from mooncake_lite.common.launch import AsyncRoleProcess, RoleFailed, RoleProcess, parse_ready, role_argv

pytestmark = pytest.mark.timeout(60)

READY = 'print("{\\"event\\": \\"ready\\", \\"role\\": \\"x\\", \\"http\\": \\"127.0.0.1:1\\"}", flush=True)'


def script(*lines: str) -> list[str]:
    return [sys.executable, "-c", "import signal, sys, time\n" + "\n".join(lines)]


def test_a_ready_line_gives_its_addresses_and_nothing_else_is_one():
    assert parse_ready('{"event": "ready", "role": "store", "http": "h:1", "data": "h:2"}\n') == \
        {"http": "h:1", "data": "h:2"}
    for line in ("ready", '{"event": "ready"', '{"event": "serving"}', "[1, 2]", ""):
        assert parse_ready(line) is None
    assert role_argv("store", "--port", "0", launcher=("mc",)) == ["mc", "--role", "store", "--port", "0"]


def test_start_reads_the_ready_line_keeps_the_logs_and_stops_with_sigterm():
    lines = []
    rp = RoleProcess.launch(script('print("starting", file=sys.stderr, flush=True)', READY, "time.sleep(60)"),
                            name="x", on_line=lambda name, line: lines.append((name, line)))
    assert rp.addresses == {"http": "127.0.0.1:1"} and rp.url() == "http://127.0.0.1:1"
    assert rp.hostport("http") == ("127.0.0.1", 1)
    with pytest.raises(KeyError, match="no 'data' address"):
        rp.url("data")
    assert rp.stop() == -signal.SIGTERM
    assert rp.logs() == "starting\n" and lines == [("x", "starting")]


def test_a_process_that_exits_before_it_is_ready_fails_with_its_last_lines():
    with pytest.raises(RoleFailed, match="exited with code 3 before it was ready; last lines:\nbad flag") as info:
        RoleProcess.launch(script('print("bad flag", file=sys.stderr)', "sys.exit(3)"), name="x")
    assert info.value.name == "x" and info.value.tail == ["bad flag"]


def test_a_silent_process_times_out_and_a_stubborn_one_is_killed():
    with pytest.raises(RoleFailed, match="not ready after 0.5s"):
        RoleProcess.launch(script("time.sleep(60)"), name="x", timeout=0.5)
    rp = RoleProcess.launch(script("signal.signal(signal.SIGTERM, signal.SIG_IGN)", READY, "time.sleep(60)"),
                            name="x")
    assert rp.stop(0.5) == -signal.SIGKILL


async def test_the_async_flavour_reads_the_same_line_and_relays_the_rest():
    lines = []
    child = AsyncRoleProcess("x-0", "x", script("signal.signal(signal.SIGTERM, signal.SIG_IGN)", READY,
                                                'print("serving", file=sys.stderr, flush=True)', "time.sleep(60)"),
                             on_line=lambda name, line: lines.append(line))
    await child.start()
    assert await child.wait_ready(30) == {"http": "127.0.0.1:1"}
    assert await child.stop(0.5) == -signal.SIGKILL
    assert lines == ["serving", "(no exit 0.5s after SIGTERM; sending SIGKILL)"]

    failing = AsyncRoleProcess("y-0", "y", script("sys.exit(2)"), on_line=lambda name, line: None)
    await failing.start()
    with pytest.raises(RoleFailed, match="y-0: exited with code 2 before it was ready"):
        await failing.wait_ready(30)
