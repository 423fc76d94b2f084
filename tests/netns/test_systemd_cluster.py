"""Issue #16 item 6: the documented multi-node bring-up (docs/systemd units, the example TOML, an
env file with the token) works as documented, on 3 namespaces as nodes joined by shaped links."""

from __future__ import annotations

import pytest

from tests.netns import systemd_cluster as sc
from tests.netns.conftest import needs_netns

pytestmark = [needs_netns, pytest.mark.slow, pytest.mark.timeout(300)]
DOCUMENT = ("Mooncake keeps the attention keys and values of earlier requests in the spare DRAM of the "
            "GPU nodes, and a conductor sends each new request where the longest prefix is cached. ") * 12


def test_every_role_binds_and_advertises_its_own_nodes_address(cluster):
    for key, proc in cluster.procs.items():
        address = cluster.node_of(key).address
        assert proc.addresses and all(a.rsplit(":", 1)[0] == address for a in proc.addresses.values()), \
            (key, proc.addresses)
    body = sc.health(cluster)
    assert body["ready"] and body["prefill"] == 2 and body["decode"] == 2
    assert {i["http"].rsplit(":", 1)[0] for i in body["instances"]} == \
        {cluster.nodes.node(n).address for n in ("node2", "node3")}


def test_the_env_file_secrets_reach_every_role(cluster):
    status, _ = sc.request(f"{cluster.api}/v1/models")
    assert status == 401                       # MOONCAKE_API_KEY from the env file
    status, _ = sc.request(f"{cluster.api}/internal/v1/heartbeat", {"instance_id": "x"})
    assert status == 403                       # MOONCAKE_CLUSTER_TOKEN: internal calls need it
    status, body = sc.request(f"{cluster.api}/v1/models", headers={"Authorization": f"Bearer {cluster.api_key}"})
    assert status == 200 and body["data"]


def _indexed(body: dict) -> int:
    return sum(s["num_blocks"] for s in body["stores"])


def test_chat_second_turn_reuses_the_first_across_nodes(cluster):
    block_size = sc.example()["cluster"]["block_size"]
    before = _indexed(sc.health(cluster))
    turn1 = [{"role": "user", "content": DOCUMENT + "\nWhat does the conductor do?"}]
    status, resp1 = sc.chat(cluster, turn1)
    assert status == 200, resp1
    full_blocks = resp1["usage"]["prompt_tokens"] // block_size
    assert full_blocks >= 2
    # Write-back to the store and its block events are asynchronous: wait until they are indexed.
    sc.wait_health(cluster, lambda h: _indexed(h) >= before + full_blocks, 30)
    turn2 = turn1 + [{"role": "assistant", "content": resp1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And where are the keys kept?"}]
    status, resp2 = sc.chat(cluster, turn2)
    assert status == 200, resp2
    assert resp2["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * block_size, resp2["usage"]
    assert resp2["prompt_token_ids"][:len(resp1["prompt_token_ids"])] == resp1["prompt_token_ids"]
    # (tokens equal to the monolithic reference with reuse are tests/pd's; a full recompute of this
    # 1,500-token prompt per output token costs ~40 s on a busy 2-core box)
