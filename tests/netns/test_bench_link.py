"""``mooncake bench store --link`` and ``bench pd --link`` (bench/link/store.py, bench/link/pd.py, issue #16 item 7): small
runs over a slow link whose reports must be sane — every byte asked for moved, across the shaped
link (no faster than its rate allows), shares within (0, 1.05] — and clear refusals."""

from __future__ import annotations

import orjson
import pytest

from mooncake_lite.bench.pd import cli as pd
from mooncake_lite.bench.store import cli as store
from mooncake_lite.cluster import netns
from tests.netns.conftest import needs_netns

RATE = "50mbit"
RATE_BPS = 50_000_000


def _json(capsys) -> dict:
    return orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("bench", [store, pd])
def test_refuses_clearly_without_root_or_without_a_rate(bench, monkeypatch, capsys):
    assert bench.main(["--link", "2ms"]) == 2                  # a share needs a rate
    assert "give a rate" in capsys.readouterr().err
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert bench.main(["--link", "1gbit"]) == 2
    assert "need root" in capsys.readouterr().err


@needs_netns
@pytest.mark.timeout(120)
def test_bench_store_over_a_link_moves_every_byte_within_the_link_rate(capsys):
    size, total = 1 << 20, 2 << 20
    assert store.main(["--link", RATE, "--sizes", "1MiB", "--link-bytes", str(total), "--repeat", "1", "--json"]) == 0
    report = _json(capsys)
    assert report["links"] == [RATE]
    r = report["sizes"][str(size)]
    assert r["bytes_asked"] == total
    for op in ("socket", "put", "get"):
        over, loop = r[RATE][op], r["loopback"][op]
        assert over["all_bytes_moved"] and over["bytes_moved"] == total, op
        assert loop["all_bytes_moved"] and loop["bytes_moved"] == total, op
        # payload / (rate x time): above 0, and at most the rate (the bucket's first burst aside)
        assert 0 < over["link_share"] <= 1.05, (op, over)
        # the qdisc sent the payload plus TCP/IP/Ethernet headers (~4.6% at MTU 1500), nothing else
        assert 1.0 < over["wire_over_payload"] < 1.1, (op, over)
        assert over["drops"] == 0
        assert loop["gbps"] > 2 * over["gbps"], (op, "loopback is not limited by the link")


@needs_netns
@pytest.mark.timeout(120)
def test_bench_pd_over_a_link_streams_the_whole_kv_across_it(capsys):
    tokens = 2048      # tiny: 1 KiB of KV a token, 2 MiB in all: 0.34 s at 50 Mbit/s
    assert pd.main(["--link", RATE, "--models", "tiny", "--prompt-len", str(tokens), "--repeats", "1",
                    "--json"]) == 0
    res = _json(capsys)
    p = res["models"]["tiny"]
    assert p["prompt_len"] == tokens and p["kv_bytes"] == tokens * 1024
    r = p["links"][RATE]
    assert r["transfer_at_rate_s"] == pytest.approx(p["kv_bytes"] * 8 / RATE_BPS)
    assert 0 < r["stream_link_share"] <= 1.05, r
    assert 1.0 < r["stream_wire_over_payload"] < 1.1, r      # the KV crossed the link, once
    # every KV byte had to cross the shaped link before the end: no faster than its rate allows
    assert r["end_to_end_s"] >= 0.8 * r["transfer_at_rate_s"], r
    assert r["hidden_share"] == pytest.approx(1 - (r["end_to_end_s"] - p["compute_alone_s"]) / r["transfer_at_rate_s"])
    assert p["compute_alone_s"] > 0 and r["stream_tail_s"] > 0
