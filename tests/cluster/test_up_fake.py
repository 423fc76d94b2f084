"""``mooncake up`` as a process supervisor, driven with a fake role that keeps the contract."""

import signal
import subprocess

from tests.cluster.helpers import (marker, processes_with, read_err_until, read_until, start_up, up_command,
                                   wait_gone)


def finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_smoke_serves_a_completion_and_leaves_nothing_behind():
    tag = marker()
    proc = start_up("--model", tag, "--prefill", "2", "--decode", "1", "--smoke")
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert "answer: 'fake answer'" in out and "smoke test: OK" in out
    assert "prefill-1" in out and "/v1/chat/completions" in out  # banner lists children, curl example
    assert "[conductor]" in err and "[prefill-0]" in err     # logs relayed with role prefixes
    assert wait_gone(tag) == []


def test_sigterm_stops_everything_in_order_even_a_stubborn_child():
    tag = marker()
    proc = start_up("--model", tag, "--stop-timeout", "1", env={"FAKE_STUBBORN": "store"})
    try:
        banner = read_until(proc, "Ctrl-C stops every process")
        assert len(processes_with(tag)) == 4  # conductor, store, prefill, decode
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc)
    finally:
        proc.kill()
    assert rc == 0, err
    assert "sending SIGKILL" in err  # the store ignored SIGTERM and was killed
    assert "store-0" in banner and wait_gone(tag) == []


def test_a_second_signal_cuts_the_drain_short_and_a_third_kills_what_is_left():
    # The children run in their own sessions: only the supervisor can pass an impatient Ctrl-C on.
    # The conductor drains until hurried, the store ignores SIGTERM and SIGINT; the stop bound
    # (60 s) is never what ends them.
    tag = marker()
    proc = start_up("--model", tag, "--stop-timeout", "60", env={"FAKE_DRAIN": "conductor", "FAKE_STUBBORN": "store"})
    try:
        read_until(proc, "Ctrl-C stops every process")
        proc.send_signal(signal.SIGTERM)
        read_err_until(proc, "fake drain: waiting", timeout=30)
        proc.send_signal(signal.SIGTERM)
        log = read_err_until(proc, "stopping store-0", timeout=30)
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc, timeout=30)
    finally:
        proc.kill()
    assert "SIGTERM again to conductor" in log and "fake drain: cut short" in log
    assert rc == 0 and "SIGKILL to store-0" in err, err
    assert "conductor=0" in err and "store-0=-9" in err    # drained (cut short), then killed
    assert wait_gone(tag) == []


def test_child_failing_at_start_stops_the_rest_and_shows_its_log():
    tag = marker()
    rc, out, err = finish(start_up("--model", tag, "--smoke", env={"FAKE_FAIL": "decode"}))
    assert rc == 1
    assert "decode-0: exited with code 3 before it was ready" in err
    assert "| decode: boom, cannot start" in err   # its last log lines
    assert "smoke test" not in out and wait_gone(tag) == []


def test_cluster_token_travels_in_env_not_argv():
    tag = marker()
    rc, out, err = finish(start_up("--model", tag, "--cluster-token", "tok-s3cret", "--smoke"))
    # the fake conductor refuses registrations without the token, so reaching the smoke test
    # proves every instance got it
    assert rc == 0, err
    assert "smoke test: OK" in out
    assert "tok-s3cret" not in err and "prefill argv:" in err


def test_api_key_is_used_by_the_smoke_client():
    tag = marker()
    rc, out, err = finish(start_up("--model", tag, "--api-key", "sk-k", "--smoke"))
    assert rc == 0, err
    assert "Authorization: Bearer $MOONCAKE_API_KEY" in out


def test_killing_the_supervisor_outright_still_takes_children_down():
    tag = marker()
    proc = start_up("--model", tag)
    try:
        read_until(proc, "Ctrl-C stops every process")
        assert len(processes_with(tag)) == 4
        proc.kill()  # SIGKILL: no chance to clean up; PR_SET_PDEATHSIG must do it
        proc.wait(10)
    finally:
        proc.kill()
    assert wait_gone(tag) == []


def test_bad_flags_exit_2():
    proc = subprocess.run(up_command("--prefill", "0"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--prefill must be at least 1" in proc.stderr


def test_smoke_retries_a_429_then_explains_a_persistent_one():
    tag = marker()
    rc, out, err = finish(start_up("--model", tag, "--smoke", env={"FAKE_REJECT": "1"}))
    assert rc == 0 and "smoke test: OK" in out, err
    rc, out, err = finish(start_up("--model", tag, "--smoke", env={"FAKE_REJECT": "9"}))
    assert rc == 1 and "HTTP 429" in err and "--admission none" in err
    assert wait_gone(tag) == []


def test_sigterm_during_startup_stops_the_half_started_cluster():
    tag = marker()
    proc = start_up("--model", tag, env={"FAKE_SLOW": "decode"})
    try:
        for line in proc.stderr:              # wait until the last stage is starting
            if "decode: starting slowly" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc)
    finally:
        proc.kill()
    assert rc == 130 and "interrupted during start-up" in err and "Ctrl-C stops" not in out
    assert wait_gone(tag) == []
