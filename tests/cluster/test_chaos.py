"""``mooncake bench chaos`` on the smallest real cluster: SIGKILL, then SIGSTOP (SIGCONT after the
window), of the prefill under streaming load through the official openai client. No request
hangs, the prefill comes back and rejoins, requests after it are served, and no block, slot,
lease or in-flight request leaks. Then its figures from made-up outcomes and metrics."""

import pytest

pytest.importorskip("openai")

from mooncake_lite.bench.chaos.cli import parse_args, run  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_a_killed_or_stopped_prefill_heals_without_hangs_or_leaks():
    args = parse_args(["--model", "tiny", "--prefill", "1", "--decode", "1", "--victims", "prefill-0",
                       "--signals", "kill,stop",
                       "--up-args", "--block-size 16 --conductor-args '--admission none' "
                                    "--prefill-args=--no-profile --decode-args=--no-profile",
                       "--concurrency", "2", "--max-tokens", "4", "--settle-s", "1", "--lead-s", "1",
                       "--window-s", "2", "--quiet-s", "5", "--hang-s", "20", "--rejoin-timeout-s", "60"])
    res = run(args)
    assert [(k["victim"], k["signal"]) for k in res["kills"]] == [("prefill-0", "kill"), ("prefill-0", "stop")]
    for kill in res["kills"]:
        assert kill["hung"] == 0, kill
        assert kill["rejoined_s"] is not None, kill            # back, and counted by the conductor
        assert kill["service_restored_s"] is not None, kill    # a request after the kill was served
        assert kill["ok"] > 0 and kill["leaked"] == {}, kill
        assert kill["continued"] == 0, kill                    # a prefill's requests are retried, not continued
    assert res["up_exit_code"] == 0


def test_phase_figures_count_each_fate_and_time_the_recovery_from_the_last_failed_probe():
    from mooncake_lite.bench.chaos.load import Outcome, phase_figures
    t0 = 100.0
    load = [Outcome(99.0, 101.0, 99.5, "failed_streaming", "stream broke", 0.4),  # streaming at the kill
            Outcome(100.2, 100.3, None, "failed_before_tokens", "502"),
            Outcome(100.1, 104.0, 103.0, "ok", longest_gap_s=5.0),    # sent after the kill
            Outcome(99.0, 104.0, 101.2, "ok", longest_gap_s=2.5),     # in flight at the kill: its seam
            Outcome(101.0, 131.0, None, "hung", "ReadTimeout")]
    probes = [Outcome(100.0, 100.1, None, "failed_before_tokens", "503"),
              Outcome(100.4, 101.2, 101.2, "ok"),       # started before the last failed probe
              Outcome(100.5, 100.6, None, "failed_before_tokens", "503"),
              Outcome(101.0, 101.5, 101.5, "ok"),       # the first after it: restored at 1.5 s
              Outcome(101.5, 101.8, 101.8, "ok")]
    baseline = [Outcome(90.0, 91.0, 90.2, "ok"), Outcome(91.0, 92.0, 91.4, "ok"), Outcome(92, 93, None, "hung")]
    fig = phase_figures(load, probes, t0, baseline)
    assert (fig["requests"], fig["ok"], fig["failed_streaming"], fig["failed_before_tokens"], fig["hung"]) == \
        (5, 2, 1, 1, 1)
    assert fig["longest_gap_s"] == 2.5        # of the streams in flight at t0 only
    assert (fig["probes"], fig["probes_failed"], fig["service_restored_s"]) == (5, 2, 1.5)
    assert fig["ttft_p50_before_s"] == 0.3 and fig["ttft_p50_after_s"] == 0.5
    assert fig["errors"] == ["502", "503", "ReadTimeout", "stream broke"]
    # a probe that never succeeds after the last failure: service was not restored
    fig = phase_figures(load, probes[:3], t0, [])
    assert fig["service_restored_s"] is None and fig["ttft_p50_before_s"] is None
    assert phase_figures(load[1:3], [], t0, [])["longest_gap_s"] is None   # none was in flight at t0


def test_continuations_are_summed_over_their_causes_and_absent_is_zero():
    from mooncake_lite.bench.chaos.cli import CONTINUATIONS, counter_total
    text = ("# HELP mooncake_conductor_continuations_total streams continued\n"
            "# TYPE mooncake_conductor_continuations_total counter\n"
            'mooncake_conductor_continuations_total{cause="connection",outcome="continued"} 2.0\n'
            'mooncake_conductor_continuations_total{cause="heartbeat",outcome="continued"} 1.0\n'
            'mooncake_conductor_continuations_total{cause="heartbeat",outcome="refused"} 4.0\n'
            "mooncake_conductor_continuations_total_created 1.7e9\n"
            "mooncake_conductor_requests_total 40.0\n")
    assert counter_total(text, CONTINUATIONS) == 7.0
    assert counter_total(text, CONTINUATIONS, 'outcome="continued"') == 3.0   # what the bench reports
    assert counter_total("mooncake_conductor_requests_total 40.0\n", CONTINUATIONS) == 0.0


def test_an_unknown_signal_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--signals", "kill,pause"])
    err = capsys.readouterr().err
    assert "--signals" in err and "pause" in err


def test_a_kill_reports_row_is_flat_and_renders():
    from mooncake_lite.bench.chaos.cli import KillReport, render
    from mooncake_lite.bench.chaos.load import Outcome, phase_figures
    fig = phase_figures([Outcome(99.0, 101.0, 99.5, "ok", longest_gap_s=0.7)], [], 100.0, [])
    row = KillReport("decode-0", "stop", fig, continued=1, rejoined_s=2.5, leaked={}).to_dict()
    assert (row["victim"], row["signal"], row["requests"], row["ok"], row["longest_gap_s"], row["continued"]) == \
        ("decode-0", "stop", 1, 1, 0.7, 1)
    text = render({"model": "tiny", "commit": None, "cluster": {}, "load": {"concurrency": 2, "max_tokens": 4},
                   "kills": [row]})
    assert text.splitlines()[-1].split()[:4] == ["decode-0", "stop", "1", "0"]   # victim, signal, requests, hung
