"""Each stage of the kit as a process under its own time limit, its output kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str                  # ok | failed | timeout | skipped
    seconds: float
    limit_s: float
    output: dict | None = None   # the stage's JSON (its stdout's last line)
    note: str = ""               # why it failed, or what it ran instead
    log: str | None = None       # the file its stderr went to

    def to_dict(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 2), "limit_s": self.limit_s,
                "note": self.note, "log": self.log, "output": self.output}


def run_stage(name: str, argv: list[str], limit_s: float, out_dir: Path, *, json_output: bool = True,
              env: dict[str, str] | None = None) -> StageResult:
    """Run ``argv`` in its own process group, killed whole at ``limit_s``; stdout is parsed as
    JSON (its last line) when ``json_output``, else kept as text under ``{"text": ...}``."""
    log = out_dir / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            stdout, _ = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return StageResult(name, "timeout", time.monotonic() - t0, limit_s, note=f"killed at {limit_s:g} s",
                               log=log.name)
    seconds = time.monotonic() - t0
    output = _parse(stdout, json_output)
    if proc.returncode != 0 or output is None:
        tail = log.read_text().strip().splitlines()[-3:]
        return StageResult(name, "failed", seconds, limit_s, output, f"exit {proc.returncode}: " + " | ".join(tail),
                           log.name)
    return StageResult(name, "ok", seconds, limit_s, output, log=log.name)


def _parse(stdout: str, json_output: bool) -> dict | None:
    lines = stdout.strip().splitlines()
    if not json_output:
        return {"text": stdout.strip()}
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def skipped(name: str, limit_s: float, why: str) -> StageResult:
    return StageResult(name, "skipped", 0.0, limit_s, note=why)
