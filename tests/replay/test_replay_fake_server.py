"""``mooncake bench replay`` end to end against an in-process fake OpenAI streaming server."""


import aiohttp
import orjson
import pytest

from mooncake_lite.bench.replay.cli import main, parse_args
from mooncake_lite.bench.replay.client import request_body, stream_one
from mooncake_lite.bench.replay.metrics import compute_metrics
from mooncake_lite.bench.replay.run import read_window, resolve_tokenizer
from mooncake_lite.bench.replay.workload import SynthRequest
from tests.conftest import TRACE, needs_trace
from tests.real_model import SMOLLM, needs_smollm
from tests.replay.fake_openai import FakeState, ThreadServer

pytestmark = pytest.mark.timeout(120)


def replay_args(url, out, *extra):
    return ["--trace", str(TRACE), "--base-url", url, "--max-requests", "30", "--speed", "20",
            "--scale", str(1 / 32), "--max-output-tokens", "8", "--output-dir", str(out), "--no-progress", *extra]


@needs_trace
def test_replay_slice_reports_metrics_rejections_and_cache_hits(tmp_path, capsys):
    st = FakeState(block_chars=16, reject_every=7)
    with ThreadServer(st) as srv:
        rc = main(replay_args(srv.url, tmp_path, "--json", "--goodput", "ttft:60000", "tpot:60000"))
    assert rc == 0
    summary = orjson.loads(capsys.readouterr().out)
    m, cache = summary["metrics"], summary["cache"]
    assert len(st.received) == 30 and m["num_requests"] == 30
    assert m["num_rejected_429"] == 4 and m["completed"] == 26 and m["num_failed"] == 0   # 7th,14th,21st,28th
    assert m["total_output_tokens"] == sum(b["max_tokens"] for i, (_, b) in enumerate(st.received, 1) if i % 7)
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # generous SLOs: all good
    assert m["mean_ttft_ms"] > 0 and m["p99_itl_ms"] >= m["median_itl_ms"] > 0
    # hit rate comes from the server's counters, and the shared hash id 0 makes it positive
    assert cache["cache_hit_rate"] == pytest.approx(st.reused_blocks / st.prompt_blocks) and st.reused_blocks > 0
    assert cache["requests_with_prefix_hit"] > 0 and 0 < cache["ideal_block_hit_rate"] < 1
    # the measured hit rate: usage cached_tokens over the prompt tokens of the finished requests
    served = [len(b["prompt"]) for i, (_, b) in enumerate(st.received, 1) if i % 7]
    assert cache["cached_tokens"] == 16 * st.reused_blocks and cache["cached_of_prompt_tokens"] == sum(served)
    assert cache["cached_token_hit_rate"] == pytest.approx(16 * st.reused_blocks / sum(served))
    assert cache["requests_reporting_cached_tokens"] == 26 and summary["config"]["tokenizer"] == "bytes"
    prompts = [b["prompt"] for _, b in st.received]
    assert len({p[:16] for p in prompts}) == 1 and len({p[16:32] for p in prompts}) > 1
    assert all(b["stream"] and b["ignore_eos"] and b["model"] == "fake-model" for _, b in st.received)
    assert max(len(p) for p in prompts) <= 2048 - 8 - 1 and summary["notes"]   # the 87k-token one was cut
    result = orjson.loads((tmp_path / "result.json").read_bytes())
    assert result["metrics"] == m and len(result["per_request"]["ttfts"]) == 26
    assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_trace
def test_arrival_spread_sends_a_rounded_timestamp_s_requests_across_its_interval():
    """The conversation trace's first ten requests share timestamp 0 (its 3 s resolution): as
    recorded they leave at one instant; spread, across the interval (3 s / speed), in time order."""
    def window(*extra):
        return read_window(parse_args(["--trace", str(TRACE), "--max-requests", "10", "--speed", "0.5", *extra]))
    assert {r.arrival_s for r in window()} == {0.0}
    spread = [r.arrival_s for r in window("--arrival-spread", "3s")]
    assert spread == sorted(spread) and len(set(spread)) == 10 and 0.0 <= spread[0] and spread[-1] < 6.0
    assert spread[-1] - spread[0] > 1.0 and [r.arrival_s for r in window("--arrival-spread", "3s")] == spread


@needs_trace
def test_text_table_and_duration_window(tmp_path, capsys):
    with ThreadServer(FakeState()) as srv:
        # trace seconds 0..6 at speed 20 -> the first 0.3 s of replay time hold 29 requests
        rc = main(["--trace", str(TRACE), "--base-url", srv.url, "--speed", "20", "--duration", "0.3",
                   "--scale", "auto", "--max-output-tokens", "4", "--output-dir", str(tmp_path), "--no-progress",
                   "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0 and "Successful requests" in out and "Mean TBT (ms):" in out
    assert "29" in out.split("Successful requests")[1].split("\n")[0]
    assert not (tmp_path / "cdf.png").exists()


@needs_trace
def test_block_tokens_aligned_with_the_server_block_give_hits(tmp_path, capsys):
    st = FakeState(block_chars=16)
    with ThreadServer(st) as srv:
        assert main(replay_args(srv.url, tmp_path, "--block-tokens", "32", "--max-requests", "12", "--json",
                                "--no-plot")) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["config"]["block_tokens"] == 32
    # hash id 0 (32 tokens = two 16-char server blocks) is shared by all 12 requests
    assert st.reused_blocks == 2 * 11 and summary["cache"]["cache_hit_rate"] > 0


class ScriptedClock:
    def __init__(self, times):
        self.times = iter(times)

    def __call__(self):
        return next(self.times)


async def test_recorded_stream_on_a_fake_clock():
    """The client stamps send, each chunk, and the usage line; the metrics follow by hand."""
    req = SynthRequest(0, 0.0, "hello world!", 12, 3, 0, False)
    clock = ScriptedClock([10.0, 10.2, 10.25, 10.4, 10.45])   # send, 3 chunks, usage line
    st = FakeState()
    with ThreadServer(st) as srv:
        async with aiohttp.ClientSession() as s:
            rec = await stream_one(s, srv.url + "/v1/completions", req,
                                   request_body(req, "fake-model", ignore_eos=True), scheduled_s=10.0, clock=clock)
    assert rec.is_ok and rec.chunk_s == (10.2, 10.25, 10.4) and rec.output_tokens == 3
    assert (rec.completion_id, rec.num_placed) == ("cmpl-1", 1)    # what bench fidelity matches records by
    m = compute_metrics([rec], duration_s=1.0)
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx(100)       # (400 - 200) / (3 - 1)
    assert m["mean_itl_ms"] == pytest.approx(100)        # gaps 50 and 150
    assert m["mean_tbt_ms"] == pytest.approx(150)        # slowest of 2 gaps
    assert m["mean_e2el_ms"] == pytest.approx(400)


@needs_trace
def test_api_key_is_sent_and_a_wrong_one_is_a_failure(tmp_path, capsys):
    with ThreadServer(FakeState(api_key="sk-x")) as srv:
        assert main(replay_args(srv.url, tmp_path, "--api-key", "sk-x", "--max-requests", "3", "--json")) == 0
        assert orjson.loads(capsys.readouterr().out)["metrics"]["completed"] == 3
        assert main(replay_args(srv.url, tmp_path, "--api-key", "nope", "--max-requests", "3", "--json")) == 1
        m = orjson.loads(capsys.readouterr().out)["metrics"]
        assert m["completed"] == 0 and m["num_failed"] == 3


@needs_trace
def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["--trace", str(tmp_path / "none.jsonl"), "--output-dir", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["--trace", str(bad)]) == 2 and "missing field" in capsys.readouterr().err
    assert main(["--trace", str(TRACE), "--speed", "0"]) == 2
    assert main(["--trace", str(TRACE), "--scale", "big"]) == 2
    assert main(["--trace", str(TRACE), "--goodput", "ttft"]) == 2
    assert main(["--trace", str(TRACE), "--arrival-spread=-3s"]) == 2
    # nothing listening: reported, not a traceback
    assert main(["--trace", str(TRACE), "--base-url", "http://127.0.0.1:9", "--max-requests", "1",
                 "--output-dir", str(tmp_path), "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err


@needs_trace
def test_no_cached_tokens_in_usage_means_no_measured_hit_rate(tmp_path, capsys):
    with ThreadServer(FakeState(report_cached=False)) as srv:
        assert main(replay_args(srv.url, tmp_path, "--max-requests", "5", "--json", "--no-plot")) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["cache"]["cached_token_hit_rate"] is None
    assert summary["cache"]["requests_reporting_cached_tokens"] == 0
    assert any("cached_tokens" in n for n in summary["notes"])


def test_resolve_tokenizer_choices(tmp_path):
    assert resolve_tokenizer("bytes", "smollm2-135m")[:2] == (None, "bytes")
    tok, label, note = resolve_tokenizer("auto", "tiny")            # a preset: bytes are its tokens
    assert tok is None and "byte-level" in label and note is None
    tok, label, note = resolve_tokenizer("auto", "gpt-4o")          # another server's model
    assert tok is None and label == "bytes" and "--tokenizer" in note
    tok, label, note = resolve_tokenizer("auto", "org/model")
    assert tok is None and "--tokenizer" in note
    for bad in (str(tmp_path / "missing.gguf"), "no-such-model"):
        with pytest.raises(ValueError, match="--tokenizer"):
            resolve_tokenizer(bad, "fake-model")


@needs_smollm
@needs_trace
def test_replay_against_a_server_naming_the_real_model_counts_its_tokens(tmp_path, capsys):
    from mooncake_lite.model.tokenizer import load_tokenizer
    tok = load_tokenizer(SMOLLM, 320)
    st = FakeState(model=SMOLLM, block_chars=64)
    with ThreadServer(st) as srv:
        assert main(replay_args(srv.url, tmp_path, "--block-tokens", "64", "--max-requests", "8", "--json",
                                "--no-plot")) == 0
        text = orjson.loads(capsys.readouterr().out)
        n_text = len(st.received)
        # tokens mode: the same ids, sent as a list; the fake server caches 64-id blocks
        assert main(replay_args(srv.url, tmp_path, "--block-tokens", "64", "--max-requests", "8", "--json",
                                "--no-plot", "--prompt-mode", "tokens")) == 0
        ids_run = orjson.loads(capsys.readouterr().out)
    assert text["config"]["tokenizer"] == SMOLLM and not [n for n in text["notes"] if "bytes" in n]
    lens = orjson.loads((tmp_path / "result.json").read_bytes())["per_request"]["input_lens"]
    texts = [b["prompt"] for _, b in st.received[:n_text]]
    ids = [b["prompt"] for _, b in st.received[n_text:]]
    assert [len(tok.encode(t)) for t in texts] == [len(i) for i in ids] == lens   # the server's own count
    assert [tok.encode(t) for t in texts] == ids
    assert len({tuple(i[:64]) for i in ids}) == 1 and len({tuple(i[64:128]) for i in ids if len(i) >= 128}) > 1
    # hash id 0 (one 64-token block) is shared by all 8: the 7 after the first hit it
    assert ids_run["cache"]["cached_token_hit_rate"] == pytest.approx(
        ids_run["cache"]["cached_tokens"] / sum(lens)) and ids_run["cache"]["cached_tokens"] >= 64 * 7
