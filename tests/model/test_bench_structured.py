"""``mooncake bench structured`` on a tiny preset: both batch sizes measured, the schema's answer
accepted token by token by its own grammar (the bench fails otherwise), the compile timed."""

from __future__ import annotations

import json

import pytest

from mooncake_lite.bench.model import structured

pytest.importorskip("llguidance")


def test_bench_structured_reports_each_batch_and_the_compile(capsys):
    assert structured.main(["--model", "tiny", "--batches", "1,4", "--steps", "5", "--context", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in out["per_token"]] == [1, 4]
    for row in out["per_token"]:
        assert row["decode_step_ms"] > 0 and row["grammar_ms"] > 0
        assert row["fraction"] == pytest.approx(row["grammar_ms"] / row["decode_step_ms"])
    assert out["compile"]["fields"] == 20 and out["compile"]["matcher_ms"] > 0
