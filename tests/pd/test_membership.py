"""Registration with a (fake) conductor: fields, heartbeats, and exiting on 409."""

import asyncio
import time

import pytest

from mooncake_lite.scheduler.costs import PrefillCostModel
from tests.conftest import start_role
from tests.fakes import fake_conductor

pytestmark = pytest.mark.timeout(180)


async def test_register_heartbeat_and_exit_on_refusal():
    runner, url, seen = await fake_conductor(refuse_roles={"decode"})
    loop = asyncio.get_running_loop()
    args = ("--model", "tiny", "--block-size", "16", "--port", "0", "--conductor", url,
            "--heartbeat-interval", "0.2", "--threads", "1")
    procs = []
    try:
        decode, prefill = await asyncio.gather(
            loop.run_in_executor(None, lambda: start_role("decode", *args, "--no-profile")),
            loop.run_in_executor(None, lambda: start_role("prefill", *args, "--num-blocks", "64")))
        procs = [decode, prefill]
        rc = await loop.run_in_executor(None, lambda: decode.proc.wait(60))
        assert rc != 0 and "refused registration" in decode.logs() and "model mismatch" in decode.logs()
        deadline = time.monotonic() + 60
        while not seen["heartbeat"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        reg = next(m for m in seen["register"] if m.role == "prefill")
        assert reg.http == prefill.addresses["http"] and reg.block_size == 16 and reg.model == "tiny"
        assert reg.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4          # tiny: 4 layers, 2 kv heads, dim 16, fp32
        model = PrefillCostModel(**vars(reg.cost.prefill))            # startup profile in the scheduler's terms
        assert reg.cost.decode is None and any(v > 0 for v in model.to_dict().values())
        beat = seen["heartbeat"][0]
        assert beat.instance_id == reg.instance_id and {"queued_s", "num_queued", "free_blocks"} <= set(beat.load.reported())
    finally:
        for p in procs:
            p.stop()
        await runner.cleanup()


async def test_roles_give_peers_the_advertised_host():
    """Bound to one address, advertising another (here: a name that resolves to it), a role
    puts the advertised host in its ready line, its registration and its data addresses."""
    import urllib.request
    runner, url, seen = await fake_conductor(refuse_roles=set())
    loop = asyncio.get_running_loop()
    procs = []
    try:
        decode, store = await asyncio.gather(
            loop.run_in_executor(None, lambda: start_role(
                "decode", "--model", "tiny", "--block-size", "16", "--port", "0", "--conductor", url,
                "--heartbeat-interval", "0.2", "--threads", "1", "--no-profile", "--advertise-host", "localhost")),
            loop.run_in_executor(None, lambda: start_role(
                "store", "--port", "0", "--data-port", "0", "--dram", "16MiB", "--advertise-host", "localhost")))
        procs = [decode, store]
        deadline = time.monotonic() + 60
        while not seen["register"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        reg = seen["register"][0]
        assert reg.http == decode.addresses["http"] and reg.http.startswith("localhost:")
        assert reg.data == decode.addresses["data"] and reg.data.startswith("localhost:")
        assert store.addresses["http"].startswith("localhost:") and store.addresses["data"].startswith("localhost:")
        health = await loop.run_in_executor(None, lambda: urllib.request.urlopen(store.url() + "/health", timeout=10).read())
        assert b'"data":"' + store.addresses["data"].encode() in health.replace(b" ", b"")
    finally:
        for p in procs:
            p.stop()
        await runner.cleanup()


async def test_a_prefill_registers_its_store_by_the_id_the_store_gives_itself():
    """Dialled as 127.0.0.1, a store advertising 'localhost' tells the prefill so at the
    handshake; the prefill registers that name, the one the store's block events carry."""
    runner, url, seen = await fake_conductor(refuse_roles=set())
    loop = asyncio.get_running_loop()
    procs = []
    try:
        store = await loop.run_in_executor(None, lambda: start_role(
            "store", "--port", "0", "--data-port", "0", "--dram", "16MiB", "--advertise-host", "localhost"))
        procs.append(store)
        dialled = "127.0.0.1:" + store.addresses["data"].rsplit(":", 1)[1]
        prefill = await loop.run_in_executor(None, lambda: start_role(
            "prefill", "--model", "tiny", "--block-size", "16", "--port", "0", "--conductor", url,
            "--heartbeat-interval", "0.2", "--threads", "1", "--no-profile", "--store", dialled))
        procs.append(prefill)
        deadline = time.monotonic() + 60
        while not seen["register"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert seen["register"][0].store == store.addresses["data"] != dialled
    finally:
        for p in procs:
            p.stop()
        await runner.cleanup()
