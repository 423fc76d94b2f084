"""``mooncake bench chaos``: kill -9 and SIGSTOP prefill, decode and store in turn under a steady streaming load.

    mooncake bench chaos                                  # smollm2-135m, 2 prefill, 2 decode, 1 store
    mooncake bench chaos --victims decode-0 --signals stop --json

It starts ``mooncake up`` (restarts on), keeps ``--concurrency`` chat completions streaming through
the official ``openai`` client plus a one-token probe every ``--probe-every-s``, and for each
victim and each of ``--signals`` in turn: lets the load settle, drains it and reads every role's
leak gauges (``/metrics``), then mid-load either kills the victim with SIGKILL (``kill``: the
supervisor restarts it) or stops it with SIGSTOP (``stop``: a hang; SIGCONT once ``--window-s``
has passed), keeps the load going until the victim is back and the conductor counts every
instance again, drains, and reads the gauges once more (the load runs ``--window-s`` after the
signal and ``--after-s`` after the rejoin, whichever ends later). For each it reports

* requests **hung** (no byte for ``--hang-s``; goal 0),
* requests **failed**, split into those whose tokens were already streaming (the only ones that
  may fail) and those that failed before their first token (goal 0: they should be re-dispatched),
  and 429s (the streaming load's requests; the probes' failures are counted apart),
* **service restored**: seconds from the kill to the first token of the first probe sent after
  the last failed probe (goal ≤ 3 s where a live replacement exists), beside the probes' median
  TTFT before and after the kill (what a busy machine adds), and **rejoined**: to the victim
  being back and registered,
* **continued**: streams the conductor continued on another decode (the increase of
  ``mooncake_conductor_continuations_total{outcome="continued"}``, every cause), and the
  **longest gap** between two chunks of a stream in flight at the signal (issue #37's goals: ≤ 2 s
  after a kill, ≤ the heartbeat timeout + 2 s after a hang),
* **leaked**: leak gauges that did not return to their idle value within ``--quiet-s`` (goal none).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import orjson

from mooncake_lite.bench.chaos.load import Load, load_flags, phase_figures
from mooncake_lite.bench.harness import UpCluster
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit
from mooncake_lite.cluster.health import missing_instances
from mooncake_lite.model.source import DEFAULT_MODEL

# Gauges that must come back to their idle value once the load stops: KV blocks and slots held,
# requests queued or running, store leases, the conductor's in-flight requests.
LEAK_GAUGES = ("mooncake_prefill_free_blocks", "mooncake_prefill_num_queued", "mooncake_decode_free_blocks",
               "mooncake_decode_num_running", "mooncake_decode_num_waiting", "mooncake_decode_pending_transfers",
               "mooncake_store_leases", "mooncake_conductor_requests_in_flight")


def get_json(url: str, timeout: float = 5.0):
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return orjson.loads(resp.read())


def gauges(cluster: UpCluster) -> dict[str, float]:
    """Every leak gauge of every child, keyed ``child.gauge`` (children not answering are skipped)."""
    import urllib.request
    found: dict[str, float] = {}
    for name, child in cluster.children.items():
        try:
            with urllib.request.urlopen(f"http://{child['http']}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            metric, _, value = line.partition(" ")
            if metric in LEAK_GAUGES:
                found[f"{name}.{metric.removeprefix('mooncake_')}"] = float(value)
    return found


def leaks(cluster: UpCluster, idle: dict[str, float], quiet_s: float) -> dict[str, float]:
    """Gauges still off their idle value after up to ``quiet_s`` (aborts and frees are async)."""
    deadline = time.monotonic() + quiet_s
    while True:
        now = gauges(cluster)
        off = {k: now.get(k, float("nan")) - v for k, v in idle.items() if now.get(k) != v}
        if not off or time.monotonic() > deadline:
            return off
        time.sleep(0.25)


CONTINUATIONS = "mooncake_conductor_continuations_total"   # the conductor's, labelled by cause (#37)


def counter_total(text: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus counter's samples over all its labels in ``/metrics`` text (0 if
    absent); ``label`` (``outcome="continued"``): only the samples that carry it."""
    total = 0.0
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        if (metric == name or metric.startswith(name + "{")) and label in metric:
            total += float(value)
    return total


def continuations(cluster: UpCluster) -> float:
    """Streams the conductor has continued so far (0 when it does not say); continuations it
    refused or stopped at --migration-limit are the client's errors, counted as failures."""
    import urllib.request
    try:
        with urllib.request.urlopen(cluster.api + "/metrics", timeout=5) as resp:
            return counter_total(resp.read().decode(), CONTINUATIONS, 'outcome="continued"')
    except OSError:
        return 0.0


def wait_whole(cluster: UpCluster, want: dict[str, int], timeout: float) -> float | None:
    """Monotonic time at which the conductor counts ``want`` live instances again (None: never)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not missing_instances(get_json(cluster.api + "/health"), want):
                return time.monotonic()
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


@dataclass(frozen=True)
class KillReport:
    """What one kill or stop did: ``load.phase_figures``' counts and times (named there, once),
    the streams continued, whether the victim rejoined, and the gauges it left off their idle value."""
    victim: str
    signal: str                    # kill (SIGKILL) | stop (SIGSTOP, SIGCONT after --window-s)
    figures: dict
    continued: int
    rejoined_s: float | None
    leaked: dict[str, float]

    def to_dict(self) -> dict:
        """One row of the report, flat: the figures beside the kill's own fields."""
        return {"victim": self.victim, "signal": self.signal, **self.figures, "continued": self.continued,
                "rejoined_s": self.rejoined_s, "leaked": self.leaked}


def kill_one(cluster: UpCluster, load: Load, victim: str, a: Options, want: dict[str, int],
             how: str = "kill") -> KillReport:
    """One kill (``how`` "kill") or hang ("stop") under load, measured from an idle reading before
    to one after."""
    settled = len(load.probes)
    load.resume()
    time.sleep(a.settle_s)
    load.pause()                             # drained: the gauges show the idle cluster
    idle, first, first_probe = gauges(cluster), len(load.outcomes), len(load.probes)
    continued = continuations(cluster)
    load.resume()
    time.sleep(a.lead_s)                     # requests are streaming when the signal lands
    t0 = time.monotonic()
    pid = cluster.pid_of(victim)
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
        back = cluster.wait_event(f"{victim} is back", t0, a.rejoin_timeout_s)
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(a.window_s)           # the hang, as long as the measurement window
        finally:
            os.kill(pid, signal.SIGCONT)
        back = time.monotonic()
    whole = wait_whole(cluster, want, a.rejoin_timeout_s) if back is not None else None
    until = max(t0 + a.window_s, (whole or 0.0) + a.after_s)  # and requests get served after the rejoin
    time.sleep(max(0.0, until - time.monotonic()))
    load.pause()
    leaked = leaks(cluster, idle, a.quiet_s)
    figures = phase_figures(load.outcomes[first:], load.probes[first_probe:], t0, load.probes[settled:first_probe])
    return KillReport(victim, how, figures, continued=int(continuations(cluster) - continued),
                      rejoined_s=None if whole is None else round(max(whole, back) - t0, 2), leaked=leaked)


def run(a: Options) -> dict:
    up_args = ["--model", a.model, "--prefill", str(a.prefill), "--decode", str(a.decode),
               "--stores", str(a.stores), *shlex.split(a.up_args)]
    commit = _commit()                   # what the cluster runs: the tree as it starts
    cluster = UpCluster(up_args, ready_timeout=a.ready_timeout_s, log_path=a.up_log)
    want = {"prefill": a.prefill, "decode": a.decode}
    try:
        model = get_json(cluster.api + "/v1/models")["data"][0]["id"]
        with Load(cluster.api + "/v1", model, concurrency=a.concurrency, max_tokens=a.max_tokens,
                  hang_s=a.hang_s, probe_every_s=a.probe_every_s) as load:
            reports = [kill_one(cluster, load, victim, a, want, how)
                       for victim in a.victims.split(",") for how in a.signals.split(",")]
    finally:
        rc = cluster.stop()
    return {"model": a.model, "commit": commit, "cluster": {"prefill": a.prefill, "decode": a.decode,
            "stores": a.stores}, "load": {"concurrency": a.concurrency, "max_tokens": a.max_tokens},
            "kills": [r.to_dict() for r in reports], "up_exit_code": rc}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
    except OSError:
        return None


def render(res: dict) -> str:
    lines = [f"chaos: {res['model']}, {res['cluster']}, {res['load']['concurrency']} streams of "
             f"{res['load']['max_tokens']} tokens, commit {res['commit']}", "",
             f"{'victim':<11}{'signal':>7}{'requests':>9}{'hung':>6}{'failed streaming':>18}{'failed before 1st':>19}"
             f"{'429':>5}{'continued':>10}{'longest gap s':>15}"
             f"{'probes failed':>15}{'restored s':>12}{'rejoined s':>12}{'probe TTFT p50 before/after':>29}"
             "  leaked"]
    for k in res["kills"]:
        ttft = f"{_s(k['ttft_p50_before_s'], '-')}/{_s(k['ttft_p50_after_s'], '-')}"
        lines.append(f"{k['victim']:<11}{k['signal']:>7}{k['requests']:>9}{k['hung']:>6}{k['failed_streaming']:>18}"
                     f"{k['failed_before_tokens']:>19}{k['rejected_429']:>5}{k['continued']:>10}"
                     f"{_s(k['longest_gap_s'], '-'):>15}"
                     f"{str(k['probes_failed']) + '/' + str(k['probes']):>15}{_s(k['service_restored_s']):>12}"
                     f"{_s(k['rejoined_s']):>12}{ttft:>29}  {k['leaked'] or 'none'}")
        lines += [f"    {e}" for e in k["errors"][:3]]
    return "\n".join(lines)


def _s(value: float | None, missing: str = "never") -> str:
    return missing if value is None else f"{value:.2f}"


FLAGS = (
    flag("--model", default=DEFAULT_MODEL),
    flag("--prefill", type=int, default=2),
    flag("--decode", type=int, default=2),
    flag("--stores", type=int, default=1),
    flag("--up-args", default="", help="more flags for mooncake up, one quoted string"),
    flag("--victims", default="prefill-0,decode-0,store-0", help="children to kill or stop, in turn"),
    flag("--signals", default="kill,stop", help="what each victim gets, in turn: kill (SIGKILL), "
         "stop (SIGSTOP, then SIGCONT after --window-s)"),
    *load_flags(0.5, 1.5, 15.0, "load after the signal (at least); a stop lasts this long"),
    flag("--settle-s", type=float, default=5.0, help="load before each kill's idle reading"),
    flag("--after-s", type=float, default=3.0, help="load after the victim rejoined (at least)"),
    flag("--quiet-s", type=float, default=10.0, help="time for gauges to return to idle"),
    flag("--rejoin-timeout-s", type=float, default=180.0),
    flag("--ready-timeout-s", type=float, default=600.0),
    flag("--up-log", default=None, metavar="FILE", help="write mooncake up's log (every role's) here"),
    flag("--json", action="store_true"),
)


def parse_args(argv) -> Options:
    parser = build_parser("mooncake bench chaos", __doc__.split("\n\n")[0], FLAGS,
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = parser.parse_args(list(argv))
    unknown = set(a.signals.split(",")) - {"kill", "stop"}
    if unknown:
        parser.error(f"--signals takes kill and stop, comma-separated; got {', '.join(sorted(unknown))}")
    return freeze(a, "ChaosOptions")


def main(argv) -> int:
    if any(arg == "--conductors" or arg.startswith("--conductors=") for arg in argv):
        from mooncake_lite.bench.chaos import ha   # several conductors behind HAProxy (issue #38)
        return ha.main(argv)
    a = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the cluster we started is stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    emit(run(a), render, as_json=a.json)
    return 0
