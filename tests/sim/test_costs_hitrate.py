"""Cost presets and profiles, Table 1 hit rates on hand-made traces."""

from __future__ import annotations

import orjson
import pytest

from mooncake_lite.scheduler import PrefillCostModel
from mooncake_lite.sim.costs import calibration_table, get_hardware, llama2_70b_a800, load_profile
from mooncake_lite.sim.hitrate import hit_rate, hit_rate_table
from mooncake_lite.sim.nodes import cpp_cost_model, cpp_prefill_seconds
from tests.sim.helpers import req


def test_a800_preset_matches_reference_figures():
    hw = llama2_70b_a800()
    assert hw.kv_bytes_per_token == 327_680
    assert hw.block_bytes() == 160 * 2**20
    for row in calibration_table(hw):
        assert abs(row["error"]) < 0.15
    # Reuse pays: half the prompt cached costs much less than half the time saved is lost.
    assert hw.prefill_seconds(32768, 16384) < 0.6 * hw.prefill_seconds(32768, 0)
    assert 0.04 < hw.decode.predict(1, 2000) < 0.05            # ≈ 45 ms/token at small batch
    assert 1.2e6 < hw.decode_max_context_tokens < 1.5e6


def test_profile_roundtrip_and_errors(tmp_path):
    prof = {"name": "lab", "prefill": PrefillCostModel(c0=0.01, c1=1e-4).to_dict(),
            "decode": {"c0": 0.02, "c1": 0.0, "c2": 0.0}, "bandwidth_bytes_per_s": 5e9,
            "kv_bytes_per_token": 4096, "block_size": 16}
    path = tmp_path / "p.json"
    path.write_bytes(orjson.dumps(prof))
    hw = get_hardware(str(path))
    assert hw.name == "lab" and hw.prefill.c1 == 1e-4 and hw.decode.c0 == 0.02
    assert hw.network_bytes_per_s == 5e9 and hw.kv_bytes_per_token == 4096
    assert hw.block_size == 512          # the trace's block, not the live paging unit
    path.write_bytes(b'{"prefill": {"c9": 1}}')
    with pytest.raises(ValueError, match="unknown coefficient"):
        load_profile(path)
    path.write_bytes(b'{"prefill": {}, "kv_bytes_per_token": -3}')
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        load_profile(path)
    with pytest.raises(ValueError, match="unknown cost model"):
        get_hardware("no-such-preset")


def test_cpp_group_speeds_up_long_prompts_only():
    hw = llama2_70b_a800()
    one = cpp_prefill_seconds(hw, 65536, 0, 1, 8192)
    four = cpp_prefill_seconds(hw, 65536, 0, 4, 8192)
    assert four == pytest.approx(one * (8 + 3) / (8 * 4))
    assert cpp_prefill_seconds(hw, 4096, 0, 4, 8192) == pytest.approx(hw.prefill_seconds(4096, 0))
    fitted = cpp_cost_model(hw, 4, 8192)
    assert fitted.predict(65536, 0) == pytest.approx(four, rel=0.2)


def test_hit_rate_known_answers():
    # blocks: r0 [1,2,3]; r1 [1,2,9] hits 2; r2 [1,5] hits 1; r3 [1,2,3] hits 3 if 3 survived.
    trace = [req(0, 0, 1536, 1, [1, 2, 3]), req(1, 1, 1536, 1, [1, 2, 9]), req(2, 2, 1024, 1, [1, 5]),
             req(3, 3, 1536, 1, [1, 2, 3])]
    inf = hit_rate(trace, "lru", None)
    assert inf.block_hit_rate == pytest.approx(6 / 11)
    assert inf.token_hit_rate == pytest.approx(6 * 512 / 5632)
    # Capacity 4 under LRU: after r2 the cache holds 2,9,1,5 (3 was the oldest) -> r3 hits 1,2.
    assert hit_rate(trace, "lru", 4).block_hit_rate == pytest.approx(5 / 11)
    # Where they differ: at capacity 4 the 5th block evicts LRU's oldest (7) but length-aware's
    # deepest (3), so only length-aware hits 7 again.
    t2 = [req(0, 0, 1536, 1, [1, 2, 3]), req(1, 1, 512, 1, [7]), req(2, 2, 1536, 1, [1, 2, 3]),
          req(3, 3, 512, 1, [8]), req(4, 4, 512, 1, [7])]
    assert hit_rate(t2, "lru", 4).block_hit_rate == pytest.approx(3 / 9)
    assert hit_rate(t2, "length-aware", 4).block_hit_rate == pytest.approx(4 / 9)
    cells = hit_rate_table(trace, ["lru", "lfu"], [None, 2])
    assert [(c.policy, c.capacity_blocks) for c in cells] == [("lru", None), ("lru", 2), ("lfu", None), ("lfu", 2)]


def test_a_spill_larger_than_the_ssd_tier_reports_every_block_it_loses():
    from mooncake_lite.sim.store import NodeStore
    store = NodeStore(dram_blocks=3, ssd_blocks=2, policy="lru")
    inserted, dropped = set(), set()
    for chain in ([1, 2, 3], [4, 5, 6], [7, 8]):
        held, gone = store.insert(chain)
        inserted.update(chain)
        dropped.update(gone)
        assert held == chain
    assert {k for k in inserted if k not in store} == dropped    # the index forgets exactly these
    assert len(store) == 5


def test_prefix_load_counts_tokens_from_dram_and_ssd_at_their_rates():
    from tests.sim.helpers import toy_hardware
    hw = toy_hardware(local_load_bytes_per_s=100.0, ssd_load_bytes_per_s=10.0)   # 1 byte per token
    assert hw.prefix_load_seconds(500) == pytest.approx(5.0)
    assert hw.prefix_load_seconds(500, from_ssd_tokens=200) == pytest.approx(3.0 + 20.0)
    # the prefix a prompt reuses is capped below its last token: so is the part read from SSD
    assert hw.prefix_load_seconds(1000, from_ssd_tokens=1024) == pytest.approx(100.0)
    assert hw.prefill_seconds(2000, 500) == pytest.approx(max(hw.prefill.predict(2000, 500), 5.0))
