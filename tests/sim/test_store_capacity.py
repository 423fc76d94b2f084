"""A live store's capacity travels to the simulator (issue #36, fidelity): the conductor exports
the slots the prefills' stores report, the profile loads them (and refuses nonsense), and the
simulated store then holds that much and evicts — not the preset's terabyte, which never does."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from mooncake_lite.common.protocol import StoreCapacity
from mooncake_lite.conductor.cluster.cost_export import store_capacity
from mooncake_lite.conductor.cluster.store_watch import StoreWatch
from mooncake_lite.scheduler import PrefillCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import llama2_70b_a800, load_profile
from tests.sim.helpers import req, toy_hardware

PROFILE = {"name": "lab", "prefill": PrefillCostModel(c0=0.01, c1=1e-4).to_dict(), "block_size": 16}


def write(tmp_path, **extra):
    path = tmp_path / "p.json"
    path.write_bytes(orjson.dumps({**PROFILE, **extra}))
    return path


def test_the_export_takes_the_median_slots_of_the_prefills_stores_only_when_all_reported():
    watch = StoreWatch(10.0)
    prefills = [SimpleNamespace(reg=SimpleNamespace(store=s)) for s in ("a:1", "b:1", "b:1", "c:1")]
    for store, slots in (("a:1", 100), ("b:1", 2465), ("z:9", 1)):   # z:9 serves no prefill
        watch.heard(store, 0.0, StoreCapacity(slots, 0, "lru"))
    watch.heard("c:1", 0.0)                                           # a store from before capacity
    assert store_capacity(prefills, watch) == {}
    watch.heard("c:1", 1.0, StoreCapacity(3000, 40, "lru"))
    assert store_capacity(prefills, watch) == {"store_blocks_per_node": 2465, "ssd_blocks_per_node": 0,
                                               "eviction": "lru"}
    watch.heard("c:1", 2.0, StoreCapacity(3000, 40, "lfu"))          # they evict differently
    assert store_capacity(prefills, watch) == {}
    assert watch.silent(100.0) and store_capacity(prefills, watch) == {}   # gone silent: forgotten


def test_a_profile_carries_the_store_in_its_own_blocks_and_round_trips(tmp_path):
    hw = load_profile(write(tmp_path, store_blocks_per_node=2465, ssd_blocks_per_node=100, eviction="lfu"))
    assert (hw.store_blocks_per_node, hw.ssd_blocks_per_node, hw.store_block_tokens, hw.eviction) == \
        (2465, 100, 16, "lfu")
    # The simulator's block is the trace's (512 tokens here): as many tokens as the live slots hold.
    assert hw.block_size == 512 and hw.dram_blocks() == 2465 * 16 // 512 and hw.ssd_blocks() == 3
    again = load_profile(write(tmp_path, **hw.to_dict()))
    assert again.to_dict() == hw.to_dict() and again.dram_blocks() == hw.dram_blocks()
    plain = load_profile(write(tmp_path))                            # no store keys: from DRAM bytes
    assert plain.store_blocks_per_node is None and plain.ssd_blocks() == 0
    assert plain.dram_blocks() == llama2_70b_a800().dram_blocks()
    assert "store_blocks_per_node" not in plain.to_dict()


@pytest.mark.parametrize(("extra", "field"), [
    ({"store_blocks_per_node": -1}, "store_blocks_per_node"),
    ({"store_blocks_per_node": 24.5}, "store_blocks_per_node"),
    ({"store_blocks_per_node": True}, "store_blocks_per_node"),
    ({"ssd_blocks_per_node": 10**13}, "ssd_blocks_per_node"),
    ({"ssd_blocks_per_node": "0"}, "ssd_blocks_per_node"),
    ({"store_blocks_per_node": 10, "store_block_tokens": 0}, "store_block_tokens"),
    ({"eviction": "fifo"}, "eviction"),
])
def test_a_bad_store_figure_is_refused_naming_the_field_and_file(tmp_path, extra, field):
    with pytest.raises(ValueError, match=rf"p\.json: {field}"):
        load_profile(write(tmp_path, **extra))


def conversations(turns: int = 3, users: int = 6, blocks: int = 4) -> list:
    """Each user's turn extends its previous prompt by a block; users take turns round-robin."""
    out = []
    for turn in range(turns):
        for u in range(users):
            n = (blocks + turn) * 512
            out.append(req(len(out), 0.5 * len(out), n, 2, [100 * u + k for k in range(blocks + turn)]))
    return out


def reused(hw, **cfg) -> int:
    sim = MooncakeSim(SimConfig(num_prefill=1, num_decode=1, seed=0, **cfg,
                                scheduler=SchedulerConfig(admission="none", ttft_slo_s=100.0, tbt_slo_s=10.0)),
                      hardware=hw)
    return sum(r.reused_tokens for r in sim.run(conversations()).requests)


def test_the_simulated_store_holds_what_the_profile_says_and_evicts(tmp_path):
    unbounded = reused(toy_hardware())
    assert unbounded == sum((4 + t - 1) * 512 for t in (1, 2) for _ in range(6))   # every later turn
    small = load_profile(write(tmp_path, store_blocks_per_node=8 * 32, block_size=16),   # 8 trace blocks
                         base=toy_hardware())
    assert small.dram_blocks() == 8
    bounded = reused(small)
    assert 0 <= bounded < unbounded / 2            # six users' prefixes do not fit in eight blocks
    assert reused(small, store_blocks_per_node=10**4) == unbounded   # the caller's figure still wins
