"""The real processes around several conductors: etcd on free loopback ports (its own temporary
data dir) and HAProxy in front of the conductors (``/health?ready`` every 200 ms, fall 2,
retries with redispatch on connection failures and empty responses), for ``mooncake bench chaos
--conductors N`` and the HA tests. Debian's ``etcd-server`` and ``haproxy`` (``bin/_env.sh``
installs them where it runs as root); :class:`Missing` names the package otherwise."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from mooncake_lite.common.ports import free_port

T = TypeVar("T")


class Missing(RuntimeError):
    """etcd or HAProxy is not installed here."""


def need(binary: str, package: str) -> str:
    path = shutil.which(binary) or next((p for p in (f"/usr/bin/{binary}", f"/usr/sbin/{binary}")
                                         if Path(p).is_file()), None)
    if path is None:
        raise Missing(f"{binary} not found: install Debian's {package} (bin/_env.sh does, as root)")
    return path


def wait_http(url: str, what: str, timeout: float = 20.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == status:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer {status} at {url} within {timeout:g}s")
        time.sleep(0.05)


class Etcd:
    """One etcd member on 127.0.0.1; :meth:`kill` and :meth:`start` again keep its data and ports."""

    def __init__(self) -> None:
        self.binary = need("etcd", "etcd-server")
        self.dir = tempfile.mkdtemp(prefix="mooncake-etcd-")
        self.client, self.peer = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client}"

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", self.dir, "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(self.url + "/health", "etcd")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


HAPROXY_CFG = """\
global
    maxconn 2000
defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response
frontend api
    bind 127.0.0.1:{port}
    http-response set-header X-Conductor %[srv_name]
    default_backend conductors
backend conductors
    balance roundrobin
    option httpchk GET /health?ready
    http-check expect status 200
    default-server inter 200ms fall 2 rise 2
{servers}
listen stats
    bind 127.0.0.1:{stats}
    stats enable
    stats uri /stats
"""


class HAProxy:
    def __init__(self, conductors: dict[str, int]) -> None:
        self.binary = need("haproxy", "haproxy")
        self.port, self.stats = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="mooncake-haproxy-")
        servers = "\n".join(f"    server {name} 127.0.0.1:{port} check" for name, port in conductors.items())
        self.cfg = Path(self.dir) / "haproxy.cfg"
        self.cfg.write_text(HAPROXY_CFG.format(port=self.port, stats=self.stats, servers=servers))
        self.proc = subprocess.Popen([self.binary, "-f", str(self.cfg), "-db"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        wait_http(f"http://127.0.0.1:{self.stats}/stats", "haproxy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, str]:
        """Each server's status as HAProxy's checks have it (UP, DOWN, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats}/stats;csv", timeout=2) as resp:
            lines = resp.read().decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","))) for line in lines[1:] if line]
        return {r["svname"]: r["status"] for r in rows if r["pxname"] == "conductors"
                and r["svname"] not in ("FRONTEND", "BACKEND")}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def balanced(conductors: dict[str, int]) -> HAProxy:
    """HAProxy in front of ``conductors`` (name: port), once its checks have them all UP (views rebuilt)."""
    proxy = HAProxy(conductors)
    deadline = time.monotonic() + 60
    while set(proxy.status().values()) != {"UP"}:
        if time.monotonic() > deadline:
            proxy.close()
            raise TimeoutError(f"conductors {list(conductors)} not all UP in HAProxy: {proxy.status()}")
        time.sleep(0.1)
    return proxy


def interleaved(conductors: dict[str, int], runs: int, measure: Callable[[str, int, int], T],
                counts: tuple[int, ...] = (1, 2, 3)) -> dict[int, list[T]]:
    """``measure(url, round, n)`` through HAProxy in front of the first ``n`` conductors, for each
    ``n`` of ``counts`` in turn, ``runs`` rounds: the counts interleave, so the drift of a shared
    machine falls on all of them alike, and each round starts one later (1 2 3, 2 3 1, 3 1 2), so
    no count always follows the same one."""
    out: dict[int, list[T]] = {n: [] for n in counts}
    for r in range(runs):
        for n in counts[r % len(counts):] + counts[:r % len(counts)]:
            proxy = balanced(dict(list(conductors.items())[:n]))
            try:
                out[n].append(measure(proxy.url, r, n))
            finally:
                proxy.close()
    return out


def spread(runs: list[dict[str, float | None]]) -> dict[str, dict]:
    """Each figure's runs, mean and spread (max - min) over the runs that have it."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = {"runs": [round(v, 4) for v in values], "mean": round(statistics.mean(values), 4) if values else None,
                    "spread": round(max(values) - min(values), 4) if values else None}
    return out
