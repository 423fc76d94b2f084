"""A 3-node cluster brought up as docs/operations.md says, in network namespaces.

Each role runs the ``ExecStart`` of its unit in ``docs/systemd/`` with the environment its
``Environment``/``EnvironmentFile`` lines give (an env file holding the cluster token and API
key, mode 0600); each node's ``/etc/mooncake/mooncake.toml`` is ``docs/config.example.toml``
edited as the bring-up says to (host, conductor, devices) plus what a CPU box needs (memory
sizes, an SSD directory of its own). Layout: node1 the conductor; node2 and node3 each a store,
a prefill and a decode (operations.md's node B pattern with a prefill beside it).
"""

from __future__ import annotations

import json
import secrets
import signal
import shutil
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mooncake_lite.cluster.netns import Node, Nodes
from mooncake_lite.common.launch import RoleProcess
from tests.netns.units import read_unit

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "docs" / "systemd"
EXAMPLE = REPO / "docs" / "config.example.toml"
CONFIG_PATH, ENV_PATH = "/etc/mooncake/mooncake.toml", "/etc/mooncake/mooncake.env"
LAYOUT = {"node1": ("conductor",), "node2": ("store", "prefill", "decode"), "node3": ("store", "prefill", "decode")}
# Short, so a cut node is noticed within the test's budget, yet longer than the ~4.5 s between an
# idle store's keepalives, or the conductor drops live stores from its index as silent.
DEAD_AFTER = 6.0


def example() -> dict:
    return tomllib.loads(EXAMPLE.read_text())


def node_config(example: dict, node: Node, conductor: str, state_dir: Path) -> dict:
    """The example file as one node's operator would edit it for this box."""
    cfg = {section: dict(values) for section, values in example.items()}
    cfg["cluster"].update(host=node.address, conductor=conductor)
    # admission off: the instances skip profiling (below), so the conductor would judge SLOs on the
    # default cost models, not this box's (CI: a 429 "bound by its measured spread" under load)
    cfg["conductor"].update(dead_after=f"{DEAD_AFTER:g}s", admission="none")
    cfg["store"].update(dram="256MiB", ssd_dir=str(state_dir / "ssd"), ssd="1GiB")
    for role in ("prefill", "decode"):   # CPU only; profiling skipped to save start-up time
        cfg[role].update(device="cpu", dtype="float32", kv_memory="64MiB", profile=False)
    cfg["prefill"]["store"] = f"{node.address}:{cfg['store']['data_port']}"
    return cfg


def dump_toml(cfg: dict) -> str:
    """TOML for tables of scalars (all the example file has)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)
    return "".join(f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in values.items()) + "\n"
                   for section, values in cfg.items())


def local_command(argv: tuple[str, ...]) -> list[str]:
    """The unit's ``/opt/mooncake/.venv/bin/mooncake`` is this checkout's executable."""
    if Path(argv[0]).name != "mooncake":
        raise ValueError(f"ExecStart runs {argv[0]!r}, not mooncake")
    exe = shutil.which("mooncake", path=str(Path(sys.executable).parent))
    return [*([exe] if exe else [sys.executable, "-m", "mooncake_lite"]), *argv[1:]]


@dataclass
class Cluster:
    nodes: Nodes
    api: str                       # http://node1:port
    api_key: str
    token: str
    procs: dict[str, RoleProcess] = field(default_factory=dict)    # "node2/prefill" -> process

    def node_of(self, key: str) -> Node:
        return self.nodes.node(key.split("/")[0])


def start(nodes: Nodes, tmp: Path, timeout: float = 180.0) -> Cluster:
    """Write each node's files, start every role from its unit, wait until all are registered."""
    base = example()
    conductor = f"http://{nodes.node('node1').address}:{base['conductor']['port']}"
    cluster = Cluster(nodes, conductor, secrets.token_urlsafe(16), secrets.token_urlsafe(24))
    env_file = tmp / "mooncake.env"
    env_file.write_text(f"MOONCAKE_CLUSTER_TOKEN={cluster.token}\nMOONCAKE_API_KEY={cluster.api_key}\n")
    env_file.chmod(0o600)
    for name in LAYOUT:
        (tmp / name).mkdir()
        (tmp / name / "mooncake.toml").write_text(dump_toml(node_config(base, nodes.node(name), conductor,
                                                                          tmp / name)))
    pending = []
    for stage in (("conductor",), ("store",), ("prefill", "decode")):   # the documented order
        for name, roles in LAYOUT.items():
            node, paths = nodes.node(name), {CONFIG_PATH: str(tmp / name / "mooncake.toml"), ENV_PATH: str(env_file)}
            for role in sorted(set(roles) & set(stage)):
                unit = read_unit(UNITS / f"mooncake-{role}.service", paths)
                proc = nodes.start(node, f"{name}/{role}", local_command(unit.exec_start), env=unit.env,
                                   cwd=tmp, timeout=None)
                cluster.procs[f"{name}/{role}"] = proc
                pending.append(proc)
        for proc in pending:
            proc.wait_ready(timeout)
        pending.clear()
    def registered(body: dict) -> bool:
        exited = [key for key, proc in cluster.procs.items() if proc.proc.poll() is not None]
        if exited:
            raise AssertionError(f"{', '.join(exited)} exited")
        return body["prefill"] == 2 and body["decode"] == 2

    try:
        wait_health(cluster, registered, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs(cluster)}") from None
    return cluster


def stop(cluster: Cluster, timeout: float = 15.0) -> None:
    """Stop as `mooncake up` does: the conductor (its drain still needs the instances), then the
    instances together, then the stores together; whatever is left goes with the namespaces."""
    for roles in (("conductor",), ("prefill", "decode"), ("store",)):
        group = [p for key, p in cluster.procs.items() if key.split("/")[1] in roles]
        for proc in group:
            proc.send(signal.SIGTERM)
        for proc in group:
            proc.stop(timeout)


def logs(cluster: Cluster, lines: int = 15) -> str:
    """The last log lines of every role, to say why something did not happen."""
    return "\n".join(f"--- {key} (pid {proc.pid}, exit {proc.proc.poll()}):\n"
                     + "\n".join(proc.logs().splitlines()[-lines:]) for key, proc in cluster.procs.items())


def request(url: str, body: dict | None = None, headers: dict | None = None,
            timeout: float = 60.0) -> tuple[int, dict]:
    """One HTTP call (JSON in, JSON out); the status and body also for 4xx/5xx."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"raw": raw.decode(errors="replace")}


def health(cluster: Cluster) -> dict:
    return request(f"{cluster.api}/health", timeout=10)[1]


def wait_health(cluster: Cluster, done, timeout: float) -> tuple[dict, float]:
    """Poll the conductor's /health until ``done(body)``; the body and the seconds it took."""
    start = time.monotonic()
    while True:
        try:
            body = health(cluster)
            if done(body):
                return body, time.monotonic() - start
        except OSError:
            body = None
        if time.monotonic() - start > timeout:
            raise AssertionError(f"conductor /health not as expected after {timeout:g}s: {body}")
        time.sleep(0.1)


def wait_until(done, timeout: float, what) -> None:
    """Poll ``done()``; AssertionError saying ``what`` (a string, or a function making one) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:g}s: {what() if callable(what) else what}")
        time.sleep(0.1)


def chat(cluster: Cluster, messages: list[dict], max_tokens: int = 16, timeout: float = 60.0) -> tuple[int, dict]:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    return request(f"{cluster.api}/v1/chat/completions", body, {"Authorization": f"Bearer {cluster.api_key}"},
                   timeout=timeout)
