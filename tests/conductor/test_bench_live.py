"""The live-latency benchmark's plumbing, in-process and tiny (its figures are not asserted)."""

from __future__ import annotations

import argparse

from mooncake_lite.bench.conductor import live as conductor_live
from mooncake_lite.common.protocol import Register, dumps


async def test_live_bench_measures_both_paths(make_cluster, aiohttp_server):
    cluster = await make_cluster(prefill=0, decode=0, block_size=16)
    server = await aiohttp_server(conductor_live._instances_app(1 << 20))
    http = f"127.0.0.1:{server.port}"
    for role in ("prefill", "decode"):
        reg = Register(role, f"bench-{role}", http, http if role == "decode" else None, None, "tiny", 16, 0,
                       512, 4096)
        async with cluster.session.post(cluster.url + "/internal/v1/register", data=dumps(reg)) as r:
            assert r.status == 200
    args = argparse.Namespace(live_requests=5, live_max_tokens=4, live_warmup=1)
    f = await conductor_live._measure(args, cluster.url, http)
    assert f["requests"] == 5 and f["max_tokens"] == 4
    for key in ("ttft_conductor_median_ms", "e2e_direct_median_ms", "e2e_added_median_ms",
                "e2e_added_median_vs_target"):
        assert isinstance(f[key], float)
    conductor_live.render(f)

