"""The report's machine line: written once (bench/report.py), said the same by every benchmark
that records it."""

from __future__ import annotations

import os

from mooncake_lite.bench.link.pd import render_pd
from mooncake_lite.bench.link.store import render_store
from mooncake_lite.bench.pd.tp_send import render as render_tp_send
from mooncake_lite.bench.report import machine, machine_text
from mooncake_lite.bench.store.cli import render as render_store_local
from mooncake_lite.bench.store.head_slices import render as render_slices


def test_the_machine_is_its_cpus_and_the_load_before_and_after():
    m = machine(0.25)
    assert m["cpus"] == os.cpu_count() and m["load_avg_1m"] == 0.25 and m["load_avg_1m_end"] >= 0
    assert machine_text({"cpus": 2, "load_avg_1m": 0.5, "load_avg_1m_end": 1.234}) == "2 CPUs, load 0.50 -> 1.23"


def test_every_benchmark_that_records_the_machine_says_it_the_same_way():
    m = {"cpus": 2, "load_avg_1m": 0.5, "load_avg_1m_end": 1.234}
    said = "2 CPUs, load 0.50 -> 1.23"
    modes = {"ranks send": {"ttft_ms": 2.0, "bytes_through_rank0": 0}, "rank 0 gathers": {"ttft_ms": 4.0,
                                                                                          "bytes_through_rank0": 1 << 20}}
    texts = [render_store_local({"machine": m, "repeat": 3, "sizes": {}}),
             render_slices({"machine": m, "model": "tiny", "block_bytes": 1024, "layers": 2, "heads": 2,
                            "repeat": 3, "figures": {}}),
             render_tp_send({"machine": m, "model": "tiny", "tp": 2, "prompt_len": 64, "repeats": 3, "modes": modes}),
             render_pd({"machine": m, "links": ["50mbit"], "repeats": 1, "models": {}}),
             render_store({"machine": m, "nodes": {"store": "a", "client": "b"}, "links": ["50mbit"], "repeat": 1,
                           "bytes_per_op": 1024, "sizes": {}})]
    assert all(said in text for text in texts), texts
