"""The prefill stage engine without sockets: load/compute order, store bytes, validation, helpers."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_kernels import pack_blocks
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.protocol import PrefillRequest, Sampling
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import PrefillAborted, StageEngine
from mooncake_lite.prefill.results import Firsts
from mooncake_lite.prefill.config import Config
from mooncake_lite.prefill.stage_process import layer_slices
from mooncake_lite.prefill.stage_process import stage_argv
from mooncake_lite.prefill.service import PrefillRejected, PrefillService
from mooncake_lite.prefill.store_io import MemoryStore

BS = 8


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=5)


class RecordingSender:
    def __init__(self):
        self.frames, self.error, self.ended = [], None, None

    def send_layer(self, layer, start, kv):
        self.frames.append((layer, start, kv.clone()))

    async def end(self, first_layer, end_layer, first_token, resume=None):
        self.ended = (first_layer, end_layer, first_token)
        self.resume = resume

    async def abort(self, reason):
        self.aborted = reason


def layer_bytes(model):
    return 2 * BS * model.args.num_kv_heads * model.args.head_dim * 4


async def run_prompt(stage, tokens, chunk, hit=0, sender=None):
    sender = sender or RecordingSender()
    keys = prefix_hash(tokens, BS)
    job = stage.begin("r", tokens, keys, hit, sender)
    try:
        out = None
        for start in range(hit * BS, len(tokens), chunk):
            out = await stage.run_chunk(job, start, token_ids=tokens[start:start + chunk])
        await stage.finish(job, Firsts((int(torch.argmax(out)),)))
    finally:
        await stage.release(job)
    return sender


def tokens_of(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def test_next_layer_load_is_launched_before_this_layer_computes(model):
    store = MemoryStore((0, 4), layer_bytes(model))
    runner = ModelRunner(model, num_blocks=32, block_size=BS)
    stage = StageEngine(runner, store, ThreadPoolExecutor(1))
    tokens = tokens_of(3 * BS + 5)
    await run_prompt(stage, tokens, chunk=BS)
    await stage.drain_puts()
    assert len(store) == 3                               # the three full blocks were written back
    events = []
    real_get, real_layer = store.get_layers, stage._layer

    async def get_layers(keys, first, num, out=None):
        events.append(("load", first))
        return await real_get(keys, first, num, out=out)

    def layer(piece, i):
        events.append(("compute", i))
        return real_layer(piece, i)

    class Sender(RecordingSender):
        def send_layer(self, layer, start, kv):
            events.append(("send", layer, start))
            super().send_layer(layer, start, kv)

    store.get_layers, stage._layer = get_layers, layer
    sender = await run_prompt(stage, tokens, chunk=100, hit=3, sender=Sender())
    # each layer's prefix goes out as soon as it is loaded, its new KV as soon as it is computed,
    # while the next layer's load is already under way
    assert events == [("load", 0), ("load", 1), ("send", 0, 0), ("compute", 0), ("send", 0, 24),
                      ("load", 2), ("send", 1, 0), ("compute", 1), ("send", 1, 24),
                      ("load", 3), ("send", 2, 0), ("compute", 2), ("send", 2, 24),
                      ("send", 3, 0), ("compute", 3), ("send", 3, 24)]
    # each layer streamed its 24 prefix tokens and its 5 new ones
    assert [(f[0], f[1], f[2].shape[1]) for f in sender.frames] == \
        [(layer, start, n) for layer in range(4) for start, n in ((0, 24), (24, 5))]


async def test_streamed_and_stored_kv_equal_a_plain_prefill(model):
    tokens = tokens_of(2 * BS + 3, 1)
    ref = ModelRunner(model, num_blocks=8, block_size=BS)
    table = ref.allocator.allocate(3)
    ref.prefill(tokens, table, 0)
    store = MemoryStore((0, 4), layer_bytes(model))
    stage = StageEngine(ModelRunner(model, num_blocks=8, block_size=BS), store, ThreadPoolExecutor(1))
    sender = await run_prompt(stage, tokens, chunk=5)
    await stage.drain_puts()
    keys = prefix_hash(tokens, BS)
    expected = pack_blocks(ref.cache.kv, torch.tensor(table[:2]))
    for i, key in enumerate(keys):
        stored = torch.frombuffer(bytearray((await store.get_layers([key], 0, 4))[0]), dtype=torch.float32)
        torch.testing.assert_close(stored, expected[i].flatten(), rtol=0, atol=1e-5)
    for layer in range(4):      # the frames of each layer, in order, cover every position once
        kv = torch.cat([f[2] for f in sender.frames if f[0] == layer], dim=1)
        k_ref, v_ref = ref.cache.layer(layer)
        pos = torch.arange(len(tokens))
        slots = torch.tensor(table)[pos // BS] * BS + pos % BS
        torch.testing.assert_close(kv[0], k_ref.flatten(0, 1)[slots], rtol=0, atol=1e-5)
        torch.testing.assert_close(kv[1], v_ref.flatten(0, 1)[slots], rtol=0, atol=1e-5)


async def test_abort_and_broken_stream_stop_between_layers_and_free(model):
    runner = ModelRunner(model, num_blocks=8, block_size=BS)
    stage = StageEngine(runner, None, ThreadPoolExecutor(1))
    sender = RecordingSender()
    job = stage.begin("x", tokens_of(20), [], 0, sender)
    sender.error = "KV stream to decode failed: connection lost"
    with pytest.raises(PrefillAborted, match="connection lost"):
        await stage.run_chunk(job, 0, token_ids=tokens_of(20))
    await stage.release(job, "gone")
    assert runner.allocator.num_free == 8 and stage.jobs == {} and sender.aborted == "gone"


def test_memory_store_assembles_stage_slices_and_evicts():
    import asyncio
    store = MemoryStore((0, 4), 8, max_blocks=2)

    async def go():
        await store.put_layers([b"a"], [memoryview(bytes(range(16)))], 0, 2)
        assert await store.match([b"a"]) == 0           # layers 2..3 still missing
        await store.put_layers([b"a"], [memoryview(bytes(range(16, 32)))], 2, 2)
        assert await store.match([b"a", b"b"]) == 1
        assert bytes((await store.get_layers([b"a"], 1, 2))[0]) == bytes(range(8, 24))
        for key in (b"b", b"c"):
            await store.put_layers([key], [memoryview(bytes(32))], 0, 4)
        assert await store.match([b"a"]) == 0            # LRU evicted the oldest
        with pytest.raises(ValueError):
            await store.put_layers([b"d"], [memoryview(bytes(5))], 0, 4)
    asyncio.run(go())


async def test_service_validates_requests(model):
    stage = StageEngine(ModelRunner(model, num_blocks=4, block_size=BS), None, ThreadPoolExecutor(1))
    service = PrefillService(stage, None, block_size=BS, hash_seed=0, chunk_size=8)
    toks = tuple(tokens_of(20))

    def req(**kw):
        base = dict(request_id="r", transfer_id="t", token_ids=toks, decode_data="127.0.0.1:1", sampling=Sampling())
        return PrefillRequest(**{**base, **kw})
    good = [k.hex() for k in prefix_hash(toks, BS)]
    assert service.check(req(prefix_keys=tuple(good[:1])))
    for bad, fragment in ((req(token_ids=()), "empty"), (req(token_ids=(1, 999)), "token ids"),
                          (req(token_ids=tuple(range(40))), "KV blocks"),
                          (req(prefix_keys=("ab" * 16,)), "prefix_keys"),
                          (req(sampling=Sampling(top_p=0.0)), "top_p"),
                          (req(migrate_keys=("zz",)), "migrate_keys"),
                          (req(decode_data="nowhere"), "decode_data")):
        with pytest.raises(PrefillRejected, match=fragment):
            service.check(bad)


def test_layer_slices_and_stage_command_line():
    assert layer_slices(4, 2) == [(0, 2), (2, 4)]
    assert layer_slices(12, 5) == [(0, 2), (2, 5), (5, 7), (7, 10), (10, 12)]
    with pytest.raises(ValueError):
        layer_slices(2, 3)
    cfg = Config(model="tiny", pipeline_group=3, threads=1, store="127.0.0.1:9", write_back=False, port=8000)
    argv = stage_argv(cfg, 2, "127.0.0.1:7")
    assert argv[argv.index("--pipeline-stage") + 1] == "2" and argv[argv.index("--next-stage") + 1] == "127.0.0.1:7"
    assert "--no-write-back" in argv and argv[argv.index("--store") + 1] == "127.0.0.1:9"
    assert argv[argv.index("--port") + 1] == "0" and "--conductor" not in argv


def test_cost_fits_are_exact_on_clean_data_and_never_negative():
    from mooncake_lite.instance.profile import fit_decode, fit_prefill
    true = dict(c0=0.004, c1=2e-5, c2=3e-8, c3=1e-6)
    pts = [(n + p, p) for n, p in ((32, 0), (96, 0), (192, 0), (64, 128), (32, 192), (128, 64))]
    model = fit_prefill([(t, p, true["c0"] + true["c1"] * (t - p) + true["c2"] * (t - p) * t + true["c3"] * p)
                         for t, p in pts])
    assert model.to_dict() == pytest.approx(true, rel=1e-6)
    # noise that would fit a negative per-sequence term gets a zero instead
    noisy = fit_decode([(1, 64, 0.012), (4, 256, 0.011), (8, 512, 0.010), (1, 512, 0.012), (8, 2048, 0.013)])
    assert min(noisy.to_dict().values()) >= 0.0 and noisy.predict(1, 64) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_payload_round_trip_any_dtype(dtype):
    from mooncake_lite.transfer.kv_stream import tensor_from_payload, token_kv_bytes
    from mooncake_lite.prefill.kv_sender import tensor_bytes
    kv = torch.randn(2, 5, 2, 16).to(dtype)
    raw = tensor_bytes(kv)
    assert raw.nbytes == token_kv_bytes(5, 2, 16, dtype)
    received = [memoryview(bytearray(raw[:7])), memoryview(bytearray(raw[7:]))]   # split across buffers
    assert torch.equal(tensor_from_payload(received, 5, 2, 16, dtype), kv)
    assert torch.equal(tensor_from_payload([memoryview(bytearray(raw))], 5, 2, 16, dtype), kv)


async def test_each_job_reports_the_steal_its_forwards_ran_beside(model):
    """The machine's stolen CPU seconds, and the process's threads' seconds on a CPU and on the
    run queue, are read around each forward: a job's ``steal_s``, ``cpu_s`` and ``runqueue_s``
    are what its chunks met (a packed forward's, for every job in it), and a machine that does
    not say leaves them out."""
    readings = iter([10.0, 10.25, 11.0, 11.5, 20.0, 20.0, 30.0, 30.75])
    threads = iter([(1.0, 0.5), (1.5, 0.75), (2.0, 1.0), (2.25, 1.0)] + [(5.0, 2.0)] * 4)
    stage = StageEngine(ModelRunner(model, num_blocks=16, block_size=BS), None, ThreadPoolExecutor(1))
    stage.steal = lambda: next(readings)
    stage.threads = lambda: next(threads)
    tokens = tokens_of(2 * BS, 2)
    job = stage.begin("r", tokens, [], 0, RecordingSender())
    try:
        for start in range(0, len(tokens), BS):                # two chunks: 0.25 s and 0.5 s stolen
            await stage.run_chunk(job, start, token_ids=tokens[start:start + BS])
        assert job.timings["steal_s"] == pytest.approx(0.75)
        assert (job.timings["cpu_s"], job.timings["runqueue_s"]) == pytest.approx((0.75, 0.25))
        assert job.timings["compute_s"] > 0
    finally:
        await stage.release(job)
    prompts = [tokens_of(BS + 1, 3 + i) for i in range(2)]
    jobs = [stage.begin(f"p{i}", p, [], 0, RecordingSender()) for i, p in enumerate(prompts)]
    try:
        await stage.run_packed([(j, 0, p[:BS]) for j, p in zip(jobs, prompts)])   # nothing stolen
        await stage.run_packed([(jobs[0], BS, prompts[0][BS:])])                  # 0.75 s stolen
        assert [j.timings["steal_s"] for j in jobs] == pytest.approx([0.75, 0.0])
        assert stage.forward_steal_seconds == pytest.approx(1.5)   # per forward, not per job: 0.25 + 0.5 + 0 + 0.75
        figures = stage.steal_figures()
        assert figures["forward_seconds_total"] == stage.forward_seconds > 0
        assert (figures["forward_cpu_seconds_total"], figures["forward_runqueue_seconds_total"]) == \
            pytest.approx((0.75, 0.25))   # the packed forwards' threads read the same before and after
    finally:
        for j in jobs:
            await stage.release(j)
    stage.steal = stage.threads = lambda: None
    quiet = stage.begin("q", tokens, [], 0, RecordingSender())
    try:
        await stage.run_chunk(quiet, 0, token_ids=tokens)
        assert not {"steal_s", "cpu_s", "runqueue_s"} & set(quiet.timings) and quiet.timings["compute_s"] > 0
    finally:
        await stage.release(quiet)


def test_the_profile_line_says_what_the_host_stole_meanwhile():
    import time
    from types import SimpleNamespace

    from mooncake_lite.prefill.main import _stolen
    readings = iter([5.0, 5.75])
    stage = SimpleNamespace(steal=lambda: next(readings))
    t0 = time.monotonic() - 10.0
    assert _stolen(stage, stage.steal(), t0).startswith("; the host stole 0.75 CPU-s of its 10.")
    assert _stolen(SimpleNamespace(steal=lambda: None), None, t0) == ""
