"""``bench fidelity``'s live side: the cluster it starts (or the one it is given), warm-up, the
replay through ``bench replay``'s own pieces, the metrics scraped around it, the exported cost
model and the instances' timelines, and the figures of the replayed requests."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from mooncake_lite.bench.fidelity.report import Side
from mooncake_lite.bench.harness import UpCluster
from mooncake_lite.bench.options import Options
from mooncake_lite.bench.replay.metrics import token_gaps


def live_side(records: Sequence) -> Side:
    from mooncake_lite.bench.replay.metrics import ttft
    from mooncake_lite.common.tbt import paper_tbt
    ok = [r for r in records if r.is_ok]
    return Side(ttft=tuple(ttft(r) for r in ok),
                tbt=tuple(t for r in ok if (t := paper_tbt(token_gaps(r))) is not None),
                completed=len(ok), rejected=frozenset(r.request_id for r in records if r.is_rejected),
                failed=sum(not r.is_ok and not r.is_rejected for r in records),
                prefix_hit_tokens=sum(r.cached_tokens or 0 for r in ok),
                prompt_tokens=sum(server_tokens(r) for r in ok),
                hit_tokens={r.request_id: r.cached_tokens or 0 for r in ok})


def server_tokens(record) -> int:
    return record.server_prompt_tokens if record.server_prompt_tokens is not None else record.prompt_tokens


def start_cluster(ns: Options) -> UpCluster:
    args = ["--model", ns.model, "--prefill", str(ns.prefill), "--decode", str(ns.decode),
            "--block-size", str(ns.block_tokens)]
    conductor = ["--admission", ns.admission, "--ttft-slo-factor", str(ns.ttft_slo_factor),
                 "--tbt-slo-factor", str(ns.tbt_slo_factor), "--burst-window", f"{ns.burst_window}s",
                 "--ttft-admit-margin", str(ns.ttft_admit_margin)]
    conductor += ["--ttft-slo", f"{ns.ttft_slo}s"] if ns.ttft_slo else []
    conductor += ["--tbt-slo", f"{ns.tbt_slo}s"] if ns.tbt_slo else []
    args += ["--conductor-args", " ".join(conductor)]
    # the decodes' own TBT check by the same SLO as the conductor's, as the simulated decodes judge
    decode = ["--tbt-slo-factor", str(ns.tbt_slo_factor)] + (["--tbt-slo", f"{ns.tbt_slo}s"] if ns.tbt_slo else [])
    args += ["--decode-args", " ".join(decode)]
    args += ["--prefill-args", ns.prefill_args] if getattr(ns, "prefill_args", "") else []
    if ns.token:
        args += ["--cluster-token", ns.token]
    # Every role's log (mooncake up's stderr) beside the results: what the cluster did, for a
    # run read back later (its defaults move: a prefill borrows idle decode CPUs since a5d488c).
    Path(ns.output_dir).mkdir(parents=True, exist_ok=True)
    return UpCluster(args, ready_timeout=ns.ready_timeout, log_path=str(Path(ns.output_dir) / "up.log"))


def warm_up(api: str, num: int, timeout_s: float = 120.0) -> None:
    """``num`` short completions, one after another, before the replay (and before the metrics it
    is measured by): a freshly started instance's first forwards and steps run cold (in one run
    the first 211-token prefill took 2.6 s against the model's 0.8), which is start-up, not the
    steady state the simulator prices. Each prompt differs from its first block on, so neither
    these nor the trace's prompts reuse each other's blocks."""
    import urllib.request
    model = served_model(api) if num > 0 else None
    for i in range(num):
        body = {"model": model, "max_tokens": 8, "stream": False,
                "prompt": f"Warm-up {i}, not part of the trace. " + "The quick brown fox jumps over the lazy dog. " * 20}
        req = urllib.request.Request(api.rstrip("/") + "/v1/completions", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
        except OSError as exc:
            raise RuntimeError(f"warm-up request {i} failed: {exc}") from None


def served_model(api: str) -> str | None:
    import urllib.request
    with urllib.request.urlopen(api.rstrip("/") + "/v1/models", timeout=10) as resp:
        data = orjson.loads(resp.read()).get("data") or [{}]
    return data[0].get("id")


def replay_options(ns: Options, api: str, out_dir: str) -> Options:
    """``bench replay``'s options for this slice, as its own parser makes them."""
    from mooncake_lite.bench.replay.cli import parse_args
    argv = ["--trace", ns.trace, "--base-url", api, "--max-requests", str(ns.num_requests),
            "--speed", str(ns.speed), "--block-tokens", str(ns.block_tokens), "--output-scale",
            str(ns.output_scale), "--max-output-tokens", str(ns.max_output_tokens), "--no-progress",
            "--output-dir", out_dir, "--tokenizer", ns.tokenizer, "--prompt-mode", ns.prompt_mode,
            "--arrival-spread", str(ns.arrival_spread)]
    return parse_args(argv)


async def live_replay(rns: Options, headers: dict[str, str], learned=None, held_out: int = 0) -> tuple[list, list, list, dict]:
    """(trace window, synthesized requests, records, the served model's context) — the replay's
    own pieces, so the prompts are exactly what ``bench replay`` would send. ``learned``: called
    (in a thread) just before the first of the last ``held_out`` requests is sent."""
    import aiohttp

    from mooncake_lite.bench.replay.client import served_model_info
    from mooncake_lite.bench.replay.run import build_requests, length_scale, read_window
    from mooncake_lite.bench.replay.sender import replay
    from mooncake_lite.bench.replay.workload import PromptConfig
    window = read_window(rns)
    base = rns.base_url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        model, max_context = await served_model_info(session, base)
    if model is None:
        raise ValueError(f"{base}/v1/models names no model: is the conductor up?")
    pcfg = PromptConfig(scale=length_scale(rns, window, max_context), output_scale=rns.output_scale,
                        max_output_tokens=rns.max_output_tokens, max_context=max_context, mode=rns.prompt_mode,
                        seed=rns.seed)
    notes: list[str] = []
    requests, _ = build_requests(rns, window, pcfg, model, notes)
    loop, pending = asyncio.get_running_loop(), []
    if learned is not None and 0 < held_out < len(requests):
        at = requests[-held_out].arrival_s - requests[0].arrival_s
        loop.call_later(max(0.0, at - LEARN_LEAD_S), lambda: pending.append(loop.run_in_executor(None, learned)))
    records, _ = await replay(requests, base + rns.endpoint, model, headers=headers, progress=False)
    for fut in pending:
        await fut
    return window, requests, records, {"model": model, "max_context": max_context, "notes": notes}


# the held-out slice's export is taken this long before its first request is sent (the export
# reads every instance's timeline: it must be done before any held-out request is placed)
LEARN_LEAD_S = 0.5


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    from mooncake_lite.bench.replay.client import parse_prometheus
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
            return parse_prometheus(resp.read().decode())
    except OSError:
        return {}


def scrape_all(api: str, decodes: Sequence[str], prefills: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Every role's /metrics, an instance's names prefixed by its place in its role's list."""
    def merged(urls: Sequence[str]) -> dict[str, float]:
        return {f"{i}.{k}": v for i, url in enumerate(urls) for k, v in scrape(url).items()}
    return {"conductor": scrape(api), "decode": merged(decodes), "prefill": merged(prefills)}


def export_profile(api: str, token: str | None, path: Path) -> dict:
    """``mooncake sim export-costs`` in-process: the file it writes, and that file's dict."""
    from mooncake_lite.sim.cli import export_costs_main
    argv = ["--conductor", api, "-o", str(path)] + (["--token", token] if token else [])
    if export_costs_main(argv) != 0:
        raise RuntimeError(f"exporting the cost models from {api} failed")
    return orjson.loads(path.read_bytes())


def conductor_config(api: str, token: str | None) -> dict:
    """What the conductor says of itself in ``/internal/v1/status`` (instances; admission if shown)."""
    import urllib.request

    from mooncake_lite.common.auth import cluster_headers
    req = urllib.request.Request(api.rstrip("/") + "/internal/v1/status", headers=cluster_headers(token))
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return orjson.loads(resp.read())
    except (OSError, ValueError):
        return {}


def decode_urls(status: Mapping, role: str = "decode") -> list[str]:
    urls = []
    for inst in status.get("instances", []):
        if isinstance(inst, dict) and inst.get("role") == role and inst.get("http"):
            http = str(inst["http"])
            urls.append(http if "://" in http else f"http://{http}")
    return urls


def timelines(status: Mapping, token: str | None) -> dict[str, dict]:
    """Every instance's ``GET /v1/timeline`` (decode steps, prefill forwards on the host's
    monotonic clock) by URL, as the cost export read them: kept for offline analysis."""
    import urllib.request

    from mooncake_lite.common.auth import cluster_headers
    out = {}
    for url in decode_urls(status, "prefill") + decode_urls(status, "decode"):
        req = urllib.request.Request(url.rstrip("/") + "/v1/timeline", headers=cluster_headers(token))
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                out[url] = orjson.loads(resp.read())
        except (OSError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class LiveRun:
    """The live side of a fidelity run: the trace window replayed, its prompts and records, the
    served model, the decodes' and conductor's metrics before and after, the replay's wall time,
    the exported cost-model file's dict and every instance's timeline by URL."""
    window: list
    requests: list
    records: list
    served: dict
    before: dict
    after: dict
    live_s: float
    profile: dict
    timelines: dict


def replay_live(ns: Options, api: str, out: Path) -> LiveRun:
    """Warm up, replay the slice between two metric scrapes, export the cost models (``costs.json``;
    with ``--held-out K`` also ``costs_learned.json``, taken before the last K requests were sent)
    and every instance's timeline (``timelines.json``) under ``out``."""
    import time

    from mooncake_lite.common.auth import cluster_headers
    status = conductor_config(api, ns.token)
    decodes, prefills = decode_urls(status), decode_urls(status, "prefill")
    warm_up(api, ns.warmup)
    before = scrape_all(api, decodes, prefills)
    t0 = time.perf_counter()
    held_out = getattr(ns, "held_out", 0)
    window, requests, records, served = asyncio.run(
        live_replay(replay_options(ns, api, str(out)), cluster_headers(None),
                    lambda: export_profile(api, ns.token, out / "costs_learned.json"), held_out))
    live_s = time.perf_counter() - t0
    after = scrape_all(api, decodes, prefills)
    profile = export_profile(api, ns.token, out / "costs.json")
    lines = timelines(status, ns.token)
    (out / "timelines.json").write_bytes(orjson.dumps(lines))
    return LiveRun(window, requests, records, served, before, after, live_s, profile, lines)
