"""The versioned block layout descriptor (transfer/kv_layout.py): spans of layer × head slices
and the version check every reader of block bytes goes through."""

from __future__ import annotations

import pytest

from mooncake_lite.transfer.kv_layout import (LAYOUT_VERSION, BlockLayout, HeadRange, LayoutError, heads_from_meta,
                                              layout_from_meta)


def test_a_head_range_is_one_run_per_layer_and_all_heads_one_run_in_all():
    lay = BlockLayout(num_layers=4, num_heads=3, head_bytes=10)
    assert lay.layer_bytes == 30 and lay.block_bytes == 120
    assert lay.spans(1, 2) == [(30, 60)]
    assert lay.spans(0, 4, HeadRange(1, 3)) == [(10, 20), (40, 20), (70, 20), (100, 20)]
    assert lay.spans(2, 1, HeadRange(0, 1)) == [(60, 10)]
    assert lay.slice_bytes(2, HeadRange(1, 2)) == 20 and lay.slice_bytes(4) == 120
    with pytest.raises(LayoutError, match="outside a block of 3 heads"):
        lay.spans(0, 1, HeadRange(2, 4))
    with pytest.raises(LayoutError, match="outside a 4-layer block"):
        lay.spans(3, 2)


def test_the_meta_round_trips_and_an_unknown_version_is_refused():
    lay = BlockLayout(2, 1, 64, is_replicated=True)
    assert layout_from_meta({"kvl": lay.to_meta()}, 2, 64) == lay
    assert lay.to_meta() == {"v": LAYOUT_VERSION, "heads": 1, "rep": True}
    with pytest.raises(LayoutError, match="version 2 is not one this process reads"):
        layout_from_meta({"kvl": {"v": 2, "heads": 1, "rep": False}}, 2, 64)
    for bad in (None, {"v": 1}, {"v": True, "heads": 1}, {"v": 1, "heads": 2, "rep": "yes"}):
        with pytest.raises(LayoutError):
            layout_from_meta({"kvl": bad}, 2, 64)
    with pytest.raises(LayoutError, match="replicated layout is one head"):
        BlockLayout(2, 2, 64, is_replicated=True)


def test_head_ranges_from_meta():
    assert heads_from_meta({}, 4) == HeadRange(0, 4)
    assert heads_from_meta({"heads": [1, 3]}, 4) == HeadRange(1, 3)
    for bad in ([1], [2, 2], [0, 5], ["0", 1], [True, 2], "0:2"):
        with pytest.raises(LayoutError):
            heads_from_meta({"heads": bad}, 4)
