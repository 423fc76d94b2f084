"""The kit's two outputs: one Markdown table (``gpu-check.md``) and one JSON file (``gpu-check.json``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mooncake_lite.bench.gpucheck.figures import Row
from mooncake_lite.bench.gpucheck.run import StageResult

VERDICT = {True: "met", False: "**missed**", None: "-"}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(env: dict, results: Sequence[StageResult], rows: Sequence[Row]) -> str:
    gpu = env.get("gpu") or {}
    head = [f"# bin/gpu-check, {env['date']}", "",
            f"device **{env['device']}**" + (f": {gpu['name']} ({gpu['memory_gib']:.0f} GiB)" if gpu else "")
            + f"; torch {env['torch']}; Python {env['python']}; {env['served']}"
            + ("; short form" if env.get("short") else ""), "",
            "| stage | status | seconds | limit |", "|---|---|---|---|"]
    head += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.limit_s:g} |" for r in results]
    head += [f"| total | | {sum(r.seconds for r in results) + env.get('setup_s', 0):.1f} | |", "",
             "| stage | figure | measured | goal (H200) | verdict |", "|---|---|---|---|---|"]
    head += [f"| {r.stage} | {_cell(r.figure)} | {_cell(r.measured)} | {_cell(r.goal)} | {VERDICT[r.met]} |"
             for r in rows]
    return "\n".join(head) + "\n"


def write(out_dir: Path, env: dict, results: Sequence[StageResult], rows: Sequence[Row]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "gpu-check.md", out_dir / "gpu-check.json"
    md.write_text(markdown(env, results, rows))
    js.write_text(json.dumps({"env": env, "stages": {r.name: r.to_dict() for r in results},
                              "rows": [r.to_dict() for r in rows]}, indent=1))
    return md, js
