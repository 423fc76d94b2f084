"""The upstream work of a cached context: one prefill-only job, and the store's PIN/UNPIN ops.

The job is placed like any request (Algorithm 1 picks the prefill instance, pricing what its
store already holds), queued in the membership so the scheduler sees the prefill busy, and its
KV stream goes to the conductor's sink instead of a decode instance. The blocks it writes reach
its store a moment after its answer (write-back runs beside the prefill), so pinning them
retries until the store holds every one or ``PIN_WAIT_S`` has passed.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import Sampling, dumps, error_text
from mooncake_lite.conductor.api.errors import ApiError, Rejected, unavailable, upstream_failed
from mooncake_lite.conductor.contexts.kv_sink import KVSink
from mooncake_lite.conductor.cluster.membership import PrefillJob
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.flight.placement import place, prefill_request, sent_cap
from mooncake_lite.conductor.services import Services
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer.client import FrameClient, RemoteError, split_address

PIN_WAIT_S = 10.0
END_WAIT_S = 5.0


async def prefill_only(svc: Services, sink: KVSink, job_id: str, req: ApiRequest, keys: list[bytes],
                       tenant: str) -> str:
    """Prefill ``tenant``'s ``req`` once with no decode; returns the data address of the store it
    wrote to."""
    loop = asyncio.get_running_loop()
    d, _ = place(svc, job_id, req, loop.time(), tenant=tenant)
    inst = svc.membership.get(d.prefill_id)
    if inst is None or not inst.reg.store:
        raise unavailable(f"prefill instance {d.prefill_id} has no store to keep a context in")
    transfer_id = uuid.uuid4().hex
    ended = sink.expect(transfer_id)
    cap = sent_cap(d, inst.reg)
    svc.membership.add_prefill(inst.instance_id, PrefillJob(job_id, len(req.prompt_ids),
                                                            d.reused_prefix_blocks * svc.block_size, "",
                                                            pack_cap=cap, priced_s=d.predicted_prefill_s),
                                  loop.time())
    msg = prefill_request(d, keys, job_id, transfer_id, req.prompt_ids, sink.address, Sampling(max_tokens=1), cap)
    try:
        async with svc.session.post(f"http://{inst.reg.http}/v1/prefill", data=dumps(msg),
                                    headers={"Content-Type": "application/json",
                                             **cluster_headers(svc.cluster_token)},
                                    timeout=aiohttp.ClientTimeout(total=svc.upstream_timeout_s, connect=10)) as resp:
            body = await resp.read()
        if resp.status == 429:
            raise Rejected(f"prefill instance {inst.instance_id} refused the context: {error_text(body)}", 1,
                           "upstream-refused")
        if resp.status != 200:
            raise upstream_failed(f"prefill instance {inst.instance_id} answered {resp.status}: {error_text(body)}")
        await asyncio.wait_for(ended, END_WAIT_S)   # its END frame comes before its answer
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        raise upstream_failed(f"prefill instance {inst.instance_id} failed the context: {exc!r}") from None
    finally:
        sink.forget(transfer_id)
        if not ended.done():
            ended.cancel()
        elif not ended.cancelled():
            ended.exception()   # retrieved: an abort already reported as the prefill's answer
        svc.membership.prefill_done(inst.instance_id, job_id, loop.time())
        svc.membership.release(job_id, (inst.instance_id,), loop.time())
    return inst.reg.store


async def store_pin(svc: Services, store: str, owner: str, keys: tuple[bytes, ...] | list[bytes],
                    expires_at: float, *, wait_s: float = PIN_WAIT_S) -> int:
    """Hold ``keys`` in ``store`` for ``owner`` until ``expires_at`` (unix seconds). Waits up to
    ``wait_s`` for blocks still being written; returns how many it holds."""
    meta = {"keys": "".join(k.hex() for k in keys), "pin": owner, "expires_at": expires_at}
    deadline = time.monotonic() + wait_s
    client = await _connect(svc, store)
    try:
        while True:
            num_held = (await client.request(Op.PIN, meta)).meta.get("num_held", 0)
            if num_held >= len(keys) or time.monotonic() >= deadline:
                return num_held
            await asyncio.sleep(0.05)
    except (RemoteError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
        raise unavailable(f"store {store} could not hold the context's blocks: {exc}") from None
    finally:
        await client.close()


async def store_unpin(svc: Services, store: str, owner: str) -> bool:
    """End ``owner``'s hold in ``store``; False when the store is unreachable or held nothing
    (it would expire there anyway)."""
    try:
        client = await _connect(svc, store)
    except ApiError:
        return False
    try:
        return bool((await client.request(Op.UNPIN, {"pin": owner})).meta.get("released"))
    except (RemoteError, ConnectionError, OSError, asyncio.TimeoutError):
        return False
    finally:
        await client.close()


async def _connect(svc: Services, store: str) -> FrameClient:
    try:
        host, port = split_address(store)
        return await FrameClient.connect(host, port, token=svc.cluster_token, name="conductor", timeout=5.0)
    except (ValueError, RemoteError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
        raise unavailable(f"store {store} is unreachable: {exc}") from None
