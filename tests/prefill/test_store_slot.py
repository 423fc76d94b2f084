"""The store's slot size and the served model's block bytes must agree, and nothing is lost silently:
the store names its slot size at the handshake, a prefill whose blocks do not fit refuses to start,
and every refused or failed write-back is counted in /metrics and logged (not once per request)."""

import logging
import subprocess
import sys

import pytest

from mooncake_lite.common.ports import free_port
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import make_app
from mooncake_lite.prefill.app import StoreTooSmall, store_id
from mooncake_lite.prefill.config import Config
from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.prefill.writeback import WritebackStats
from mooncake_lite.store.client import StoreClient
from mooncake_lite.transfer.client import RemoteError
from tests.conftest import REPO, start_role
from tests.pd.harness import cluster

pytestmark = pytest.mark.timeout(180)

SLOT = 64 << 10                 # the store's --slot-bytes in these tests
TINY_TOKEN_BYTES = 1024         # tiny: 2 (K, V) x 4 layers x 2 kv heads x 16 head_dim x 4 bytes (float32)
FITS, TOO_BIG = 64, 128         # block sizes: 64 KiB blocks fit a 64 KiB slot exactly, 128 KiB ones do not


@pytest.fixture(scope="module")
def small_store():
    store = start_role("store", "--port", "0", "--data-port", "0", "--slot-bytes", str(SLOT), "--dram", "4MiB")
    yield store.addresses["data"]
    store.stop()


def prefill_argv(data: str, block_size: int) -> list[str]:
    return ["--model", "tiny", "--port", "0", "--store", data, "--block-size", str(block_size),
            "--num-blocks", "16", "--no-profile", "--threads", "1"]


async def test_the_store_names_its_slot_size_at_the_handshake(small_store):
    client = await StoreClient.connect(small_store)
    try:
        assert client.slot_bytes == SLOT
        assert client.frames.hello["store_id"] == small_store
    finally:
        await client.close()


def test_a_prefill_whose_blocks_do_not_fit_its_store_refuses_to_start(small_store):
    proc = subprocess.run([sys.executable, "-m", "mooncake_lite", "--role", "prefill", "--host", "127.0.0.1",
                           *prefill_argv(small_store, TOO_BIG)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    block = TOO_BIG * TINY_TOKEN_BYTES
    assert proc.stderr.strip().splitlines()[-1] == (
        f"mooncake --role prefill: error: store {small_store} holds blocks of at most {SLOT} bytes "
        f"(--slot-bytes) but one {TOO_BIG}-token block of tiny in float32 is {block} bytes: start the store "
        f"with --slot-bytes >= {block} (or lower --block-size)")
    assert '"event": "ready"' not in proc.stdout and '"event":"ready"' not in proc.stdout


def test_a_prefill_whose_blocks_fit_exactly_starts(small_store, role_procs):
    prefill = role_procs("prefill", *prefill_argv(small_store, FITS))
    assert prefill.proc.poll() is None


class AnsweringStore:
    def __init__(self, slot_bytes):
        self.slot = slot_bytes

    async def store_id(self):
        return "10.0.0.7:8101"

    async def slot_bytes(self):
        return self.slot


async def test_the_check_in_process():
    cfg = Config(model="tiny", store="127.0.0.1:8101", block_size=TOO_BIG)
    with pytest.raises(StoreTooSmall, match=rf"--slot-bytes >= {TOO_BIG * TINY_TOKEN_BYTES} "):
        await store_id(cfg, AnsweringStore(SLOT), check=True)
    assert await store_id(cfg, AnsweringStore(TOO_BIG * TINY_TOKEN_BYTES), check=True) == "10.0.0.7:8101"
    assert await store_id(cfg, AnsweringStore(None), check=True) == "10.0.0.7:8101"   # an older store
    assert await store_id(cfg, AnsweringStore(SLOT)) == "10.0.0.7:8101"               # not asked to check


async def test_a_store_that_does_not_answer_is_registered_as_given_and_not_checked():
    port = free_port()     # a port nobody listens on
    cfg = Config(model="tiny", store=f"127.0.0.1:{port}", block_size=TOO_BIG)
    store = RemoteStore(cfg.store, None, 4, 1)
    assert await store_id(cfg, store, timeout_s=5, check=True) == cfg.store


def metrics_lines(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("mooncake_prefill_")}


async def run_one(small_store, block_size, aiohttp_client, forget_slot=False):
    """One request through an in-process prefill whose store is the small-slot store process;
    returns the stage and its /metrics."""
    model = build_model("tiny")
    layer_bytes = 2 * block_size * model.args.num_kv_heads * model.args.head_dim * 4
    store = RemoteStore(small_store, None, model.args.num_layers, layer_bytes)
    if forget_slot:                # a store too old to name its slot size: the store itself refuses
        (await store.client()).frames.hello.pop("slot_bytes")
    async with cluster(model, block_size=block_size, chunk=block_size, decode_blocks=16, prefill_blocks=8,
                       store=store) as c:
        tokens = [(7 * i) % 256 for i in range(2 * block_size + 3)]     # two full blocks
        for rid in ("a", "b"):
            await c.request(rid, tokens[:len(tokens) - (rid == "b")], max_tokens=2)
            await c.prefill.stage.drain_puts()
        client = await aiohttp_client(make_app(c.prefill))
        text = await (await client.get("/metrics")).text()
        return c.prefill.stage, metrics_lines(text)


@pytest.mark.parametrize("forget_slot, reason, fragment", [
    (False, "too_large", "does not fit store"),          # refused before sending (the store named its slot)
    (True, "bad_request", "does not fit a 65536-byte slot"),   # refused by the store
])
async def test_a_refused_write_back_is_counted_and_logged_once(small_store, aiohttp_client, caplog,
                                                              forget_slot, reason, fragment):
    caplog.set_level(logging.WARNING, logger="mooncake_lite.prefill.writeback")
    stage, metrics = await run_one(small_store, TOO_BIG, aiohttp_client, forget_slot)
    # One write-back per block (a chunk fills one block), two blocks per request, two requests.
    assert dict(stage.writebacks.failures) == {reason: 4}
    assert metrics[f'mooncake_prefill_writeback_failures_total{{reason="{reason}"}}'] == 4
    assert metrics["mooncake_prefill_writeback_blocks_failed_total"] == 4
    assert metrics["mooncake_prefill_writebacks_total"] == 0
    assert metrics["mooncake_prefill_blocks_stored_total"] == 0
    # the forwards ran (and the hypervisor's steal beside them is counted, 0 or more)
    assert stage.forward_seconds > 0 and stage.forward_steal_seconds >= 0
    assert metrics["mooncake_prefill_forward_seconds_total"] == pytest.approx(stage.forward_seconds)
    assert metrics["mooncake_prefill_forward_steal_seconds_total"] == pytest.approx(stage.forward_steal_seconds)
    records = [r.getMessage() for r in caplog.records if r.name == "mooncake_lite.prefill.writeback"]
    # The first failure at WARNING with its reason; later ones only in summaries (here flushed by
    # the drain after each request), which account for every one of them.
    assert reason in records[0] and fragment in records[0], records
    summaries = records[1:]
    assert summaries and all(" more store write-back(s) failed" in r and reason in r for r in summaries)
    assert 1 + sum(int(r.split()[0]) for r in summaries) == 4


async def test_a_write_back_that_fits_is_counted(small_store, aiohttp_client):
    stage, metrics = await run_one(small_store, FITS, aiohttp_client)
    assert not stage.writebacks.failures
    assert metrics["mooncake_prefill_writebacks_total"] >= 1
    assert metrics["mooncake_prefill_blocks_stored_total"] == 2      # the 2nd prompt's blocks were hits
    assert metrics["mooncake_prefill_writeback_blocks_failed_total"] == 0


def test_failures_are_logged_first_per_reason_then_summed_up_periodically(caplog):
    caplog.set_level(logging.WARNING, logger="mooncake_lite.prefill.writeback")
    now = [0.0]
    stats = WritebackStats(interval_s=60, clock=lambda: now[0])
    full = RemoteError("full", "no free slot")
    for _ in range(5):
        stats.failed(full, 3)
        now[0] += 1
    stats.failed(ConnectionResetError("gone"), 1)       # a new reason: said at once
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "writing 3 block(s) to the store failed (reason full)",
        "writing 1 block(s) to the store failed (reason unreachable)"]
    now[0] = 61
    stats.failed(full, 3)                               # the interval has passed: one summary
    assert caplog.records[-1].getMessage().startswith("5 more store write-back(s) failed in the last 61 s (full 5)")
    stats.failed(full, 3)
    assert len(caplog.records) == 3                     # held until the next interval (or a drain)
    stats.flush()
    assert caplog.records[-1].getMessage().startswith("1 more")
    assert stats.failures == {"full": 7, "unreachable": 1} and stats.num_blocks_failed == 22
