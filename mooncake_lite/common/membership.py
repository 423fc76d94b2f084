"""Joining the conductors: ``Register`` once the ports are known, then periodic ``Heartbeat``s, to
every conductor of the cluster.

Used by both the prefill and the decode role (through ``common/lifecycle.py``). The conductors
are a static list (``--conductor URL1,URL2,...``) or found in etcd (``--discovery
etcd://HOST:PORT``: the instance announces its registration there under a lease and reports to
every conductor listed under ``/mooncake/conductors/``, ``common/discovery.py``). Each conductor
is its own task (its own retries and backoff), so one that is down or slow delays no other.

A 409 answer means that conductor refuses this instance (model, block size or hash seed differ):
that link ends with an error logged; :class:`RegistrationRefused` ends the membership, and the
lifecycle the process, when every conductor refused, or none accepted within the registration
wait. A conductor found through etcd whose model, block size or hash seed is not ours is refused
by the instance (``Conductor.expects``) before any message is sent to it. An unreachable conductor is
retried (it may start after us); a heartbeat answered 404 (the conductor restarted and forgot us)
triggers a fresh registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp
import orjson

from mooncake_lite.common import discovery
from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.cost_report import CostReport
from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register, RunningPrefill, dumps

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}
RETRY_MAX_S = 5.0
REGISTRATION_WAIT_S = 60.0


# A nudged heartbeat goes no sooner than this share of the interval after the last one: a prefill
# whose chunks take milliseconds (a GPU) must not post one a chunk.
NUDGE_MIN_GAP = 0.25


class RegistrationRefused(RuntimeError):
    pass


class Nudge:
    """Tells every conductor link (:class:`_Links`) to send its next heartbeat now rather than at
    the end of its interval: a prefill fires it as a chunk of a job it runs alone ends, when its
    report of that job's end (``RunningPrefill``) is best. One event per link, so a link that
    was posting when it fired still beats again at once."""

    def __init__(self) -> None:
        self._events: list[asyncio.Event] = []

    def subscribe(self) -> asyncio.Event:
        event = asyncio.Event()
        self._events.append(event)
        return event

    def unsubscribe(self, event: asyncio.Event) -> None:
        with contextlib.suppress(ValueError):
            self._events.remove(event)

    def fire(self) -> None:
        for event in self._events:
            event.set()


def conductor_urls(value: str | None, option: str = "--conductor") -> tuple[str, ...]:
    """``--conductor URL1,URL2,...`` (or ``option``'s) as its URLs (each http(s)://); ValueError
    naming the option and the bad one."""
    urls = tuple(u.strip().rstrip("/") for u in (value or "").split(",") if u.strip())
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{option} must be http(s) URLs separated by commas, got {url!r}")
    return urls


@dataclass(frozen=True)
class Conductor:
    """The conductors an instance joins (``--conductor``, one URL or several separated by commas;
    or ``discovery``, an etcd URL), the secret it presents (``--cluster-token``) and how often it
    reports its load (``--heartbeat-interval``)."""
    url: str
    token: str | None = None
    heartbeat_interval_s: float = 1.0
    discovery: str | None = None
    # What a conductor found in etcd must serve to be ours: (field, value) pairs of its entry,
    # e.g. (("model", "smollm2-135m"), ("block_size", 512), ("hash_seed", 0)).
    expects: tuple[tuple[str, object], ...] = ()

    @property
    def urls(self) -> tuple[str, ...]:
        return conductor_urls(self.url)

    def refuses(self, entry: dict) -> str | None:
        """Why the conductor of etcd ``entry`` is not one this process may join (None: it is)."""
        wrong = [f"{k} {entry.get(k)!r} (ours: {v!r})" for k, v in self.expects if entry.get(k) != v]
        return "mismatched " + "; ".join(wrong) if wrong else None


async def register(session: aiohttp.ClientSession, url: str, token: str | None, msg: Register,
                   retry_s: float = 0.5, max_wait_s: float = REGISTRATION_WAIT_S) -> None:
    """POST the registration to the conductor at ``url``, retrying (with backoff) while it is
    unreachable, at most ``max_wait_s``; 409 raises."""
    endpoint, waited, delay = url.rstrip("/") + "/internal/v1/register", 0.0, retry_s
    while True:
        try:
            async with session.post(endpoint, data=dumps(msg), headers={**JSON, **cluster_headers(token)}) as resp:
                body = await resp.text()
                if resp.status == 409:
                    raise RegistrationRefused(f"conductor {url} refused registration: {body.strip()}")
                if resp.status < 300:
                    log.info("registered with conductor %s as %s", url, msg.instance_id)
                    return
                log.warning("conductor %s answered %d to register: %s", url, resp.status, body[:300])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:   # the session's total timeout is the latter
            if delay == retry_s:   # once per outage
                log.warning("conductor %s unreachable (%r); retrying", url, exc)
        if waited >= max_wait_s:
            raise RegistrationRefused(f"could not register with conductor {url} within {max_wait_s:g}s")
        await asyncio.sleep(delay)
        waited += delay
        delay = min(delay * 2, RETRY_MAX_S)


class _Links:
    """One task per conductor: register, then heartbeat; :meth:`set_urls` follows the list."""

    def __init__(self, session: aiohttp.ClientSession, conductor: Conductor, msg: Register,
                 load: Callable[[], InstanceLoad], cost: Callable[[], CostReport | None],
                 running: Callable[[], RunningPrefill | None], nudge: Nudge | None = None) -> None:
        self.session, self.conductor, self.msg, self.load, self.cost = session, conductor, msg, load, cost
        self.running, self.nudge = running, nudge
        self.tasks: dict[str, asyncio.Task] = {}
        self.refused: dict[str, str] = {}
        self.registered = asyncio.Event()
        self.changed = asyncio.Event()

    def set_urls(self, urls: tuple[str, ...]) -> None:
        for url in set(self.tasks) - set(urls):
            log.info("conductor %s left the cluster's list; no longer reporting to it", url)
            self.tasks.pop(url).cancel()
        for url in urls:
            if url not in self.tasks and url not in self.refused:
                self.tasks[url] = asyncio.create_task(self._link(url), name=f"conductor-link {url}")
        self.changed.set()

    async def _link(self, url: str) -> None:
        try:
            await register(self.session, url, self.conductor.token, self.msg, max_wait_s=float("inf"))
            self.registered.set()
            await self._beat(url)
        except RegistrationRefused as exc:
            log.error("%s; not reporting to it", exc)
            self.refused[url] = str(exc)
            self.tasks.pop(url, None)
            self.changed.set()

    async def _beat(self, url: str) -> None:
        hb_url = url + "/internal/v1/heartbeat"
        headers = {**JSON, **cluster_headers(self.conductor.token)}
        nudged = self.nudge.subscribe() if self.nudge is not None else None
        try:
            while True:
                await _pause(self.conductor.heartbeat_interval_s, nudged)
                await self._post(url, hb_url, headers)
        finally:
            if nudged is not None:
                self.nudge.unsubscribe(nudged)

    async def _post(self, url: str, hb_url: str, headers: dict[str, str]) -> None:
        """One heartbeat to ``url`` (a 404: register again; a 409 ends the link)."""
        current = self.cost()
        reported = InstanceLoad(**{k: float(v) for k, v in self.load().reported().items()})
        try:
            beat = Heartbeat(self.msg.instance_id, reported, current, self.running())
            async with self.session.post(hb_url, data=dumps(beat), headers=headers) as resp:
                if resp.status == 404:
                    log.warning("conductor %s forgot this instance; registering again", url)
                    msg = replace(self.msg, cost=current) if current is not None else self.msg
                    await register(self.session, url, self.conductor.token, msg, max_wait_s=float("inf"))
                elif resp.status == 409:
                    raise RegistrationRefused(f"conductor {url} refused heartbeat: {(await resp.text())[:300]}")
                elif resp.status >= 400:   # e.g. a field this conductor does not know: say so, keep beating
                    log.warning("conductor %s answered a heartbeat with %d: %s", url, resp.status,
                                (await resp.text())[:300])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:   # a timeout must not end the loop
            log.warning("heartbeat to %s failed: %r", url, exc)

    async def wait(self, on_registered: Callable[[], object]) -> None:
        """Until cancelled; raises RegistrationRefused when no conductor is left that may take
        us (every one refused) or none accepted within the registration wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REGISTRATION_WAIT_S
        while not self.registered.is_set():
            self._check_refused()
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_first(self.registered, self.changed), max(deadline - loop.time(), 0))
            if not self.registered.is_set() and loop.time() >= deadline:
                raise RegistrationRefused(f"could not register with any conductor within {REGISTRATION_WAIT_S:g}s"
                                          f" ({', '.join(self.tasks) or 'none known'})")
        on_registered()
        while True:
            self._check_refused()
            self.changed.clear()
            await self.changed.wait()

    def _check_refused(self) -> None:
        if self.refused and not self.tasks:
            raise RegistrationRefused("; ".join(self.refused.values()))

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _pause(interval_s: float, nudged: asyncio.Event | None) -> None:
    """Until the next heartbeat is due: ``interval_s`` on, or a nudge but never within
    ``NUDGE_MIN_GAP`` of the interval (a nudge during that gap is kept for its end)."""
    if nudged is None:
        await asyncio.sleep(interval_s)
        return
    gap = interval_s * NUDGE_MIN_GAP
    await asyncio.sleep(gap)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(nudged.wait(), interval_s - gap)
    nudged.clear()


async def keep_membership(conductor: Conductor, msg: Register, load: Callable[[], InstanceLoad],
                          cost: Callable[[], CostReport | None],
                          running: Callable[[], RunningPrefill | None] = lambda: None,
                          on_registered: Callable[[], object] = lambda: None, nudge: Nudge | None = None) -> None:
    """Register, then heartbeat forever, with every conductor (run as a background task);
    ``on_registered`` runs once, after the first conductor accepted (the instance can be sent
    work from then on). ``cost`` gives the instance's current cost model for each heartbeat (and
    a re-registration), ``running`` a prefill's job in progress, sent early when ``nudge`` fires.
    Raises RegistrationRefused as the module says."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        links = _Links(session, conductor, msg, load, cost, running, nudge)
        background: list[asyncio.Task] = []
        if conductor.discovery:
            background = _discover(session, conductor, msg, links)
        links.set_urls(conductor.urls)   # a static list too, if given with discovery
        try:
            await links.wait(on_registered)
        finally:
            links.close()
            for task in background:
                task.cancel()


def follow_conductors(session: aiohttp.ClientSession, conductor: Conductor,
                      set_urls: Callable[[tuple[str, ...]], None]) -> asyncio.Task:
    """A task telling ``set_urls`` the static list and the conductors listed in etcd, each time
    that list changes (one not ours, by ``Conductor.expects``, is logged once and left out)."""
    etcd = discovery.client(session, conductor.discovery)
    refused: set[str] = set()

    def follow(entries: dict[str, dict]) -> None:
        urls = []
        for entry in entries.values():
            url, why = str(entry.get("url", "")), conductor.refuses(entry)
            if why is None and url.startswith(("http://", "https://")):
                urls.append(url.rstrip("/"))
            elif url not in refused:
                refused.add(url)
                log.error("refusing conductor %s found in etcd: %s", url or entry, why or "no http(s) url")
        set_urls(tuple(dict.fromkeys(conductor.urls + tuple(urls))))

    directory = discovery.Directory(etcd, discovery.CONDUCTORS, conductor.token, follow)
    return asyncio.create_task(directory.run(), name="follow-conductors")


def _discover(session: aiohttp.ClientSession, conductor: Conductor, msg: Register,
              links: _Links) -> list[asyncio.Task]:
    """Announce ``msg`` in etcd and follow the conductors listed there."""
    etcd = discovery.client(session, conductor.discovery)
    key = discovery.INSTANCES + msg.instance_id
    return [asyncio.create_task(discovery.announce(etcd, key, orjson.loads(dumps(msg)), conductor.token)),
            follow_conductors(session, conductor, links.set_urls)]
