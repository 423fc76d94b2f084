"""``mooncake status``: a live view of a running cluster, from the conductor's address.

    mooncake status --conductor http://10.0.0.5:8000            # refreshes in place; Ctrl-C quits
    mooncake status --once                                      # one frame, plain text
    mooncake status --json                                      # the conductor's answer, for scripts

Reads ``GET /internal/v1/status`` (``conductor/status.py``; it needs the cluster token when one
is set: ``--cluster-token`` or ``$MOONCAKE_CLUSTER_TOKEN``) and draws instances (role, node,
queue or batch, KV use, profiled speed, health), stores (DRAM/SSD use, hit rate) and the last
minute of traffic (TTFT/TBT quantiles, rejections by cause, requests and tokens per second, and
how far admission's predicted TTFT and TBT were from the measured ones: median and p90 error).
The live view redraws on the terminal's alternate screen with plain ANSI codes; exit code 1
when the conductor cannot be read (the live view keeps retrying and says so).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request

import orjson

from mooncake_lite.common.auth import cluster_headers

ALT_SCREEN, MAIN_SCREEN = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake status", description="live view of a running cluster")
    ap.add_argument("--conductor", default="http://127.0.0.1:8000",
                    help="the conductor's URL (default: %(default)s, mooncake up's; its --port P: port P)")
    ap.add_argument("--cluster-token", default=os.environ.get("MOONCAKE_CLUSTER_TOKEN"),
                    help="the cluster token (default: $MOONCAKE_CLUSTER_TOKEN)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    ap.add_argument("--once", action="store_true", help="print one frame and exit")
    ap.add_argument("--json", action="store_true", help="print the status as JSON once and exit")
    return ap


def fetch(conductor: str, token: str | None, timeout: float = 5.0) -> dict:
    """The conductor's status; raises OSError (urllib's errors included) when it cannot be read."""
    url = conductor.rstrip("/") + "/internal/v1/status"
    req = urllib.request.Request(url, headers=cluster_headers(token))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return orjson.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise OSError(f"{url} answered {exc.code}: {exc.read()[:200].decode(errors='replace')}") from None
    except orjson.JSONDecodeError as exc:
        raise OSError(f"{url} did not answer JSON: {exc}") from None


# ---- formatting --------------------------------------------------------------------------
def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f}ms" if x < 1 else f"{x:.2f}s"


def _quantiles(q: dict) -> str:
    if not q or not q.get("count"):
        return "no samples"
    if q.get("values"):   # a few: as measured
        return f"n={q['count']:.0f}: " + "  ".join(_secs(v) for v in q["values"])
    return f"p50 {_secs(q['p50'])}  p90 {_secs(q['p90'])}  p99 {_secs(q['p99'])}  (n={q['count']:.0f})"


def _prediction_lines(p: dict | None) -> list[str]:
    """The last minute's prediction error (|measured / predicted - 1|) and its direction, and the
    spread admission multiplies each instance's predictions by."""
    if not p:
        return []
    out = []
    for metric in ("ttft", "tbt"):
        e = p.get(metric) or {}
        if not e.get("count"):
            out.append(f"  {metric.upper()} error   no checked requests")
            continue
        out.append(f"  {metric.upper()} error   median {_pct(e['median_error'])}  p90 {_pct(e['p90_error'])}"
                   f"  measured/predicted x{e['median_ratio']:.2f}  (n={e['count']})")
    # admission judges prediction x spread (scheduler/admission.bounds): the margin each instance has
    spreads = [f"{iid} {m.upper()} x{v:.2f}" for iid, c in sorted((p.get("corrections") or {}).items())
               for m, v in sorted((c.get("spread") or {}).items())]
    if spreads:
        out.append("  admission spread  " + "  ".join(spreads))
    return out


def _continuation_lines(records: list[dict], most: int = 5) -> list[str]:
    """The newest continuations (a decode failed mid-stream): when, which request, why, and where it went on."""
    lines = [f"  continuations {len(records)} recent" if records else "  continuations none"]
    for c in records[-most:]:
        where = f"-> {c['to_prefill']} + {c['to_decode']}" if c["outcome"] == "continued" else f"({c['detail']})"
        lines.append(f"    {time.strftime('%H:%M:%S', time.localtime(c['at']))}  {c['request_id']}  {c['cause']} on "
                     f"{c['from_decode']} after {c['num_tokens']} tok: {c['outcome']} {where}")
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def _instance_row(inst: dict) -> list[str]:
    if inst["role"] == "prefill":
        work = f"queue {inst.get('queue', 0)}"
        speed = inst.get("prefill_tokens_per_s")
        speed_text = f"{speed:,.0f} tok/s" if speed else "unprofiled"
    else:
        work = f"batch {inst.get('batch', 0)}" + (f" +{inst['incoming']}" if inst.get("incoming") else "")
        step = inst.get("decode_step_s")
        speed_text = f"{_secs(step)}/step" if step else "unprofiled"
    health = inst["health"] + (f" ({inst['last_seen_s']:.1f}s)" if inst["health"] == "alive" else "")
    return [inst["role"], inst["instance_id"], inst["node"], work, _pct(inst.get("kv_used")), speed_text, health]


def _store_row(st: dict) -> list[str]:
    u = st.get("usage")
    if not u:
        return [st["store"], str(st["indexed_blocks"]), "-", "-", "-", "no usage yet"]
    dram = f"{_bytes(u.get('dram_used_bytes'))} / {_bytes(u.get('dram_capacity_bytes'))}"
    ssd = (f"{_bytes(u.get('ssd_used_bytes'))} / {_bytes(u.get('ssd_capacity_bytes'))}"
           if u.get("ssd_capacity_bytes") else "off")
    return [st["store"], str(st["indexed_blocks"]), dram, ssd, _pct(st.get("hit_rate")),
            f"{st.get('reported_s', 0):.1f}s ago"]


def render(status: dict, conductor: str) -> list[str]:
    """One frame of the view as lines (no colour, no control codes)."""
    r = status["requests"]
    sched = status.get("scheduler", {})
    lines = [f"mooncake status  {conductor}  model {status.get('model')}  strategy {sched.get('strategy')}"
             f"  admission {sched.get('admission')}  {time.strftime('%H:%M:%S', time.localtime(status['time']))}",
             "",
             f"REQUESTS (last {r['window_s']:.0f}s)  {r['requests_per_s']:.2f} req/s  {r['tokens_per_s']:.1f} tok/s"
             f"  in flight {r['in_flight']:.0f}",
             "  outcomes    " + (", ".join(f"{k} {v:.0f}" for k, v in sorted(r["outcomes"].items())) or "none"),
             "  rejections  " + (", ".join(f"{k} {v:.0f}" for k, v in sorted(r["rejections"].items())) or "none"),
             f"  TTFT        {_quantiles(r['ttft_s'])}",
             f"  TBT         {_quantiles(r['tbt_s'])}",
             *_prediction_lines(status.get("predictions")),
             *_continuation_lines(status.get("continuations") or []),
             "", "INSTANCES"]
    rows = [_instance_row(i) for i in status["instances"]]
    lines += _table(["role", "id", "node", "work", "KV used", "speed", "health"], rows) if rows else ["  none registered"]
    lines += ["", "STORES"]
    rows = [_store_row(s) for s in status["stores"]]
    lines += _table(["store", "blocks", "DRAM used", "SSD used", "hit rate", "reported"], rows) if rows \
        else ["  none heard from"]
    return lines


# ---- the view ----------------------------------------------------------------------------
def _frame(lines: list[str], width: int, height: int) -> str:
    """Redraw in place: home, each line cut to the terminal and cleared to its end, then the rest."""
    shown = [line[:width] for line in lines[:max(1, height - 1)]]
    return HOME + "".join(line + CLEAR_LINE + "\n" for line in shown) + CLEAR_BELOW


def live(args: argparse.Namespace) -> int:
    # Ctrl-C must quit the view even when started from a shell that ignores SIGINT for background
    # jobs (Python keeps an inherited SIG_IGN instead of raising KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = sys.stdout
    out.write(ALT_SCREEN)
    try:
        while True:
            size = shutil.get_terminal_size()
            try:
                lines = render(fetch(args.conductor, args.cluster_token), args.conductor)
            except OSError as exc:
                lines = [f"mooncake status  {args.conductor}", "", f"cannot read the conductor: {exc}",
                         f"retrying every {args.interval:g}s (Ctrl-C quits)"]
            out.write(_frame(lines, size.columns, size.lines))
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(MAIN_SCREEN)
        out.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        sys.stderr.write("mooncake status: error: --interval must be positive\n")
        return 2
    if not (args.once or args.json):
        return live(args)
    try:
        status = fetch(args.conductor, args.cluster_token)
    except OSError as exc:
        sys.stderr.write(f"mooncake status: error: cannot read the conductor at {args.conductor}: {exc} "
                         f"(--conductor URL names another)\n")
        return 1
    if args.json:
        sys.stdout.write(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write("\n".join(render(status, args.conductor)) + "\n")
    return 0
