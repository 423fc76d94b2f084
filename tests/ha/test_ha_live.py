"""Two conductors behind HAProxy, found through etcd: one shared cluster for every case (in order).

etcd (its own, on free loopback ports), two conductors, one store, one prefill and one decode on
the tiny preset, all with ``--discovery``; HAProxy in front (``/health`` every 200 ms, fall 2,
retries with redispatch on connection failures and empty responses). The cases run in file
order on the same processes: entries in etcd that are not ours are skipped; a conductor killed
with SIGKILL under streaming load fails only the streams it was serving and no new request;
etcd killed, serving goes on from the last view (new cached contexts refused, naming etcd) and
discovery recovers when etcd is back; a cached context made on one conductor is used, extended
and deleted on the other; the killed conductor started again answers 503 until its view is
rebuilt, then takes traffic.
Timings are printed (``-s``), never asserted.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from mooncake_lite.common import discovery
from tests.conftest import start_role
from tests.ha.cluster import Etcd, HAProxy, free_port, wait_http

pytestmark = pytest.mark.timeout(240)
TOKEN = "ha-test-token"
LIMIT = 3    # the limited tenant's max_concurrency; requests without a key are the open tenant's
TENANTS = f'[tenants]\nanonymous = "open"\n[tenants.open]\n[tenants.lim]\napi_keys = ["lim-key"]\nmax_concurrency = {LIMIT}\n'
COMMON = ("--block-size", "16", "--cluster-token", TOKEN)
MODEL = ("--model", "tiny", "--threads", "1", "--no-profile", "--heartbeat-interval", "0.2")


@dataclass
class HA:
    etcd: Etcd
    haproxy: HAProxy
    ports: dict[str, int]
    conductors: dict[str, object]
    others: dict[str, object]
    tenants: Path

    def start_conductor(self, name: str):
        self.conductors[name] = start_role("conductor", "--model", "tiny", "--port", str(self.ports[name]),
                                           "--tenants", str(self.tenants),
                                           "--discovery", f"etcd://127.0.0.1:{self.etcd.client}", "--dead-after", "3s",
                                           "--rebuild-wait", "10s", "--admission", "none", *COMMON)
        return self.conductors[name]


@pytest.fixture(scope="module")
def ha():
    etcd = Etcd()
    etcd.start()
    disc = ("--discovery", f"etcd://127.0.0.1:{etcd.client}")
    tenants = Path(etcd.dir) / "tenants.toml"
    tenants.write_text(TENANTS)
    cluster = HA(etcd, None, {"c1": free_port(), "c2": free_port()}, {}, {}, tenants)   # type: ignore[arg-type]
    try:
        data = f"127.0.0.1:{free_port()}"
        roles = {"c1": lambda: cluster.start_conductor("c1"), "c2": lambda: cluster.start_conductor("c2"),
                 "store": lambda: start_role("store", "--port", "0", "--data-port", data.rpartition(":")[2],
                                             "--dram", "64MiB", "--event-interval", "0.05", *disc, *COMMON),
                 "prefill": lambda: start_role("prefill", *MODEL, "--port", "0", "--store", data, *disc, *COMMON),
                 "decode": lambda: start_role("decode", *MODEL, "--port", "0", *disc, *COMMON)}
        with ThreadPoolExecutor(len(roles)) as pool:   # all at once: the prefill retries its store until it is up
            started = {name: pool.submit(start) for name, start in roles.items()}
            cluster.others.update({name: f.result() for name, f in started.items() if name not in cluster.ports})
        cluster.haproxy = HAProxy(cluster.ports)
        for name in ("c1", "c2"):
            wait_http(f"http://127.0.0.1:{cluster.ports[name]}/health", f"conductor {name}", timeout=30)
        yield cluster
    finally:
        for proc in [*cluster.others.values(), *cluster.conductors.values()]:
            proc.proc.kill()   # nothing here tests a graceful stop (tests/conductor/test_drain.py does)
            proc.proc.wait(10)
        if cluster.haproxy is not None:
            cluster.haproxy.close()
        etcd.close()


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    conductor: str | None
    error: str = ""


async def stream_once(session: aiohttp.ClientSession, url: str, i: int, key: str | None = None) -> Outcome:
    start, conductor = time.monotonic(), None
    body = {"model": "tiny", "prompt": f"request {i} of the load", "max_tokens": 48, "stream": True,
            "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            conductor = resp.headers.get("X-Conductor")
            if resp.status != 200:
                return Outcome(start, time.monotonic(), False, conductor, f"HTTP {resp.status} {await resp.text()}")
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    return Outcome(start, time.monotonic(), True, conductor)
                if b'"error"' in line:
                    return Outcome(start, time.monotonic(), False, conductor, line.decode()[:200])
            return Outcome(start, time.monotonic(), False, conductor, "stream ended without [DONE]")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Outcome(start, time.monotonic(), False, conductor, repr(exc))


async def run_load(url: str, seconds: float, event=None, streams: int = 4) -> list[Outcome]:
    """``streams`` clients each streaming one completion after another for ``seconds``;
    ``event`` (a coroutine function) runs meanwhile."""
    out: list[Outcome] = []
    stop_at = time.monotonic() + seconds

    async def client(k: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while time.monotonic() < stop_at:
            out.append(await stream_once(session, url, k * 1000 + i))
            i += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(k, session) for k in range(streams)), *([event()] if event else []))
    return out


def etcd_put(etcd: Etcd, key: str, value: bytes) -> None:
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                       "value": base64.b64encode(value).decode()}).encode()
    urllib.request.urlopen(urllib.request.Request(etcd.url + "/v3/kv/put", body), timeout=5).read()


def until(cond, what: str, timeout: float = 20.0) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.05)
    return time.monotonic() - start


def test_both_conductors_serve_through_haproxy(ha):
    until(lambda: set(ha.haproxy.status().values()) == {"UP"}, "both conductors UP in haproxy")
    out = asyncio.run(run_load(ha.haproxy.url, 2.0))
    assert out and all(o.ok for o in out), [o.error for o in out if not o.ok]
    assert {o.conductor for o in out} == {"c1", "c2"}
    for c in ha.conductors.values():
        assert "view rebuilt" in c.logs()


def test_a_tenants_concurrency_limit_is_divided_between_the_conductors(ha):
    """Bursts of 2 x LIMIT streams of the limited tenant at once through HAProxy: the conductors
    admit at most LIMIT together (shares 2 + 1), the rest get 429 naming the share."""
    async def burst() -> list[Outcome]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(stream_once(session, ha.haproxy.url, i, "lim-key") for i in range(2 * LIMIT)))

    admitted = []
    for _ in range(4):
        out = asyncio.run(burst())
        refused = [o for o in out if not o.ok]
        assert all("HTTP 429" in o.error and "of 2 conductors" in o.error for o in refused), [o.error for o in refused]
        admitted.append(len(out) - len(refused))
    print(f"\ntenant limits: {admitted} of {2 * LIMIT} simultaneous streams admitted per burst, limit {LIMIT}")
    assert max(admitted) <= LIMIT and min(admitted) >= 1


def test_entries_not_ours_are_skipped_and_a_foreign_conductor_refused(ha):
    etcd_put(ha.etcd, discovery.CONDUCTORS + "junk", b"\x00not json")
    etcd_put(ha.etcd, discovery.INSTANCES + "forged", discovery.sign("another-token", discovery.INSTANCES + "forged",
                                                                     {"instance_id": "forged"}))
    foreign = "http://127.0.0.1:9"
    etcd_put(ha.etcd, discovery.CONDUCTORS + foreign, discovery.sign(
        TOKEN, discovery.CONDUCTORS + foreign, {"url": foreign, "model": "small", "block_size": 16, "hash_seed": 0}))
    prefill, c2 = ha.others["prefill"], ha.conductors["c2"]
    until(lambda: f"refusing conductor {foreign} found in etcd: mismatched model 'small'" in prefill.logs(),
          "the prefill refusing the conductor of another model")
    until(lambda: "skipped the entry /mooncake/conductors/junk" in prefill.logs(), "junk skipped by the prefill")
    until(lambda: "skipped the entry /mooncake/instances/forged in etcd: bad signature" in c2.logs(),
          "a forged instance entry skipped by the conductor")
    assert all(p.proc.poll() is None for p in [*ha.others.values(), *ha.conductors.values()])


def call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_cached_context_made_on_one_conductor_is_used_and_deleted_on_the_other(ha):
    c1, c2 = (f"http://127.0.0.1:{ha.ports[c]}" for c in ("c1", "c2"))
    doc = "A document every request of this test starts with, long enough for two blocks."
    status, ctx = call(c1 + "/v1/contexts", "POST", {"model": "tiny", "prompt": doc, "ttl": 60})
    assert status == 200 and ctx["cached_tokens"] >= 32, ctx
    until(lambda: call(f"{c2}/v1/contexts/{ctx['id']}")[0] == 200, "the context known to c2")
    status, out = call(c2 + "/v1/completions", "POST", {"model": "tiny", "prompt": " and then", "max_tokens": 4,
                                                         "context_id": ctx["id"]})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] >= ctx["cached_tokens"], out
    status, out = call(f"{c2}/v1/contexts/{ctx['id']}", "PATCH", {"ttl": 120})
    assert status == 200 and out["expires_at"] > ctx["expires_at"]
    until(lambda: call(f"{c1}/v1/contexts/{ctx['id']}")[1].get("expires_at") == out["expires_at"],
          "the extension known to c1")
    assert call(f"{c2}/v1/contexts/{ctx['id']}", "DELETE")[0] == 200
    until(lambda: call(f"{c1}/v1/contexts/{ctx['id']}")[0] == 404, "the deletion known to c1")


def test_kill_a_conductor_under_streaming_load(ha):
    moved: dict[str, float] = {}

    async def kill_c1() -> None:
        await asyncio.sleep(1.5)
        moved["kill"] = time.monotonic()
        ha.conductors["c1"].proc.kill()
        loop = asyncio.get_running_loop()
        while ha.haproxy.status().get("c1") == "UP":
            await loop.run_in_executor(None, time.sleep, 0.02)
        moved["down"] = time.monotonic()

    out = asyncio.run(run_load(ha.haproxy.url, 5.0, kill_c1))
    kill = moved["kill"]
    in_flight_on_dead = [o for o in out if o.start < kill and o.conductor == "c1" and o.end >= kill]
    failed = [o for o in out if not o.ok]
    failed_new = [o for o in failed if o.start >= kill]
    print(f"\nconductor kill: {len(out)} streams, {len(failed)} failed ({len(in_flight_on_dead)} were in flight on the "
          f"killed conductor), {len(failed_new)} new requests failed; haproxy marked it down "
          f"{moved['down'] - kill:.2f}s after the kill")
    assert not failed_new, [o.error for o in failed_new]
    assert all(o in in_flight_on_dead for o in failed), [(o.conductor, o.error) for o in failed]
    assert any(o.ok and o.start >= kill for o in out)


def test_kill_etcd_serving_goes_on_and_discovery_recovers(ha):
    c2, again = ha.conductors["c2"], "read again from etcd"
    before = c2.logs().count(again)
    ha.etcd.kill()
    out = asyncio.run(run_load(ha.haproxy.url, 2.0))
    assert out and all(o.ok for o in out), [o.error for o in out if not o.ok]
    status, body = call(ha.haproxy.url + "/v1/contexts", "POST", {"model": "tiny", "prompt": "x" * 40})
    assert status == 503 and "etcd is unreachable" in body["error"]["message"], body
    start = time.monotonic()
    ha.etcd.start()
    until(lambda: c2.logs().count(again) > before, "the conductor reading etcd again", timeout=20)
    took = time.monotonic() - start
    out = asyncio.run(run_load(ha.haproxy.url, 1.0))
    assert out and all(o.ok for o in out), [o.error for o in out if not o.ok]
    print(f"\netcd kill: {len(out)} requests after its return, all served; the conductor read etcd again "
          f"{took:.2f}s after etcd was started again")


def test_restarted_conductor_rebuilds_its_view_then_takes_traffic(ha):
    start = time.monotonic()
    c1 = ha.start_conductor("c1")
    ready_s = time.monotonic() - start
    health = f"http://127.0.0.1:{ha.ports['c1']}/health"
    try:
        urllib.request.urlopen(health, timeout=2)
        first = 200
    except urllib.error.HTTPError as exc:
        first = exc.code
        assert json.loads(exc.read())["status"] == "rebuilding"
    until(lambda: "view rebuilt" in c1.logs(), "c1's view rebuilt", timeout=15)
    assert "listed in etcd reported" in c1.logs(), c1.logs()[-2000:]
    until(lambda: ha.haproxy.status().get("c1") == "UP", "c1 back in haproxy")
    out = asyncio.run(run_load(ha.haproxy.url, 1.5))
    assert out and all(o.ok for o in out), [o.error for o in out if not o.ok]
    assert "c1" in {o.conductor for o in out}
    line = next(x for x in c1.logs().splitlines() if "view rebuilt" in x)
    print(f"\nrestart: ready line {ready_s:.2f}s after the start, first /health {first}; "
          f"{line.partition('rebuild: ')[2]}")
