"""One round of ``bench store``'s figures against a live store: single, lone, batched and leased
puts and gets, each over TCP and (where the store is on this node) through shared memory."""

from __future__ import annotations

import asyncio
import os
import time

from mooncake_lite.bench.options import Options
from mooncake_lite.bench.store.limits import process_cpu
from mooncake_lite.store.client import StoreClient

ALONE_PUTS, ALONE_GAP_S = 32, 0.005   # put_alone: puts per round, idle seconds before each


def working_blocks(num_slots: int) -> int:
    """The distinct blocks the gets read, over and over (half the store's slots at most)."""
    return min(num_slots // 2, 64)


class StoreRound:
    """The blocks, keys and caller buffers of one round; each method runs one kind of op ``op``
    (``put``/``get``) on a client, appends each request's latency to ``lat`` and returns the
    bytes it moved."""

    def __init__(self, size: int, args: Options, num_slots: int):
        self.size = size
        self.block = memoryview(bytearray(os.urandom(64)) * (size // 64) + os.urandom(size % 64))
        self.count = max(16, args.bytes_per_run // size)
        self.per_batch = max(1, args.batch_bytes // size)
        self.in_flight = max(1, min(args.in_flight, (num_slots // 2) // self.per_batch))
        self.working = [os.urandom(16) for _ in range(working_blocks(num_slots))]
        self.outs = [memoryview(bytearray(size)) for _ in range(self.per_batch * self.in_flight)]
        for out in self.outs:
            out[:] = self.block   # resident, as a client's preallocated tensors are

    async def single(self, client: StoreClient, op: str, lat: list[float]) -> int:
        for i in range(self.count):
            t = time.perf_counter()
            if op == "put":
                await client.put(_fresh_keys(1), [self.block])
            elif (await client.get([self.working[i % len(self.working)]], out=self.outs[:1]))[0] is None:
                raise RuntimeError("bench bug: a get missed (the working set was evicted)")   # into the caller's buffer
            lat.append(time.perf_counter() - t)
        return self.count * self.size

    async def alone(self, client: StoreClient, op: str, lat: list[float]) -> int:
        # A few puts, each after a gap: the store's copy of the one before (staged puts are
        # answered before it) is over, so each costs what a lone put costs.
        num = min(self.count, ALONE_PUTS)
        for _ in range(num):
            await asyncio.sleep(ALONE_GAP_S)
            t = time.perf_counter()
            await client.put(_fresh_keys(1), [self.block])
            lat.append(time.perf_counter() - t)
        return num * self.size

    async def leased(self, client: StoreClient, op: str, lat: list[float]) -> int:
        num, lease = await client.match_and_pin(self.working, lease_s=60)
        if num != len(self.working):
            raise RuntimeError("bench bug: the working set is not all in the store")
        try:
            return await self.single(client, op, lat)
        finally:
            await client.release(lease)

    async def batched(self, client: StoreClient, op: str, lat: list[float]) -> int:
        per_batch, in_flight, working = self.per_batch, self.in_flight, self.working
        num_requests = max(in_flight * 2, self.count // per_batch)

        async def worker(w: int) -> None:
            for r in range(w, num_requests, in_flight):
                t = time.perf_counter()
                if op == "put":
                    await client.put(_fresh_keys(per_batch), [self.block] * per_batch)
                else:
                    keys = [working[(r * per_batch + j) % len(working)] for j in range(per_batch)]
                    got = await client.get(keys, out=self.outs[w * per_batch:(w + 1) * per_batch])
                    if any(g is None for g in got):
                        raise RuntimeError("bench bug: a get missed (the working set was evicted)")
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(worker(w) for w in range(in_flight)))
        return num_requests * per_batch * self.size


def _fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


async def measure_store(address: str, server_pid: int, size: int, args: Options, num_slots: int) -> dict[str, tuple]:
    """One round of the four store figures: op -> (GB/s, latencies, CPU s/GB of client + store)."""
    tcp = await StoreClient.connect(address, name="bench", max_batch_bytes=1 << 40, max_batch_keys=1 << 20, shm=False)
    fast = await StoreClient.connect(address, name="bench", max_batch_bytes=1 << 40, max_batch_keys=1 << 20)
    rnd = StoreRound(size, args, num_slots)
    if fast.shm is not None and fast.shm.staging is not None:
        # A connection's staging area is allocated as it is first written: pay that once, untimed.
        await rnd.batched(fast, "put", [])
    results: dict[str, tuple] = {}
    # Each op over TCP and then through shared memory, back to back: load swings hit both alike.
    plan = [(name, fn, op, client) for name, fn, op in (("put", rnd.single, "put"), ("put_alone", rnd.alone, "put"),
                                                        ("get", rnd.single, "get"), ("batched_put", rnd.batched, "put"),
                                                        ("batched_get", rnd.batched, "get"))
            for client in ((tcp, fast) if fast.transport == "shm" else (tcp,))]
    if fast.transport == "shm":
        plan.append(("leased_get", rnd.leased, "get", fast))
    for name, fn, op, client in plan:
        if op == "get":
            await client.put(rnd.working, [rnd.block] * len(rnd.working))  # the puts before may have evicted it
        lat: list[float] = []
        cpu0, server0, start = time.process_time(), process_cpu(server_pid), time.perf_counter()
        nbytes = await fn(client, op, lat)
        # A lone put's rate is over its own time, not the idle gaps between them.
        elapsed = sum(lat) if fn == rnd.alone else time.perf_counter() - start
        cpu = time.process_time() - cpu0 + process_cpu(server_pid) - server0
        results[("shm_" if client is fast else "") + name] = (nbytes / elapsed / 1e9, lat, cpu / (nbytes / 1e9))
    await tcp.close()
    await fast.close()
    results["config"] = ({"blocks_per_request": rnd.per_batch, "in_flight": rnd.in_flight, "ops_per_run": rnd.count},)
    return results
