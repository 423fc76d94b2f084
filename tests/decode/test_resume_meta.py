"""An END frame's resume point (``decode/pending.ResumePoint``): read when well formed, refused
naming the field otherwise (the sender gets a ``bad_meta`` error frame, never a crash)."""

import pytest

from mooncake_lite.decode.kv_receiver import _resume
from mooncake_lite.decode.pending import KVError, ResumePoint


def test_a_well_formed_resume_point_is_read_and_an_old_sender_means_no_write_back():
    key = bytes(range(16))
    assert _resume({"output": [5, 6], "key": key.hex(), "tail": [1, 2, 3]}) == ResumePoint((5, 6), key, (1, 2, 3))
    assert _resume({"first_token": 4}) == ResumePoint((), None, None)


@pytest.mark.parametrize("meta, field", [({"output": 5}, "output"), ({"output": [1, "x"]}, "output"),
                                         ({"tail": [True]}, "tail"), ({"key": "zz"}, "key"),
                                         ({"key": "00" * 8}, "key"), ({"key": 7}, "key")])
def test_a_bad_field_is_refused_by_name(meta, field):
    with pytest.raises(KVError, match=field) as err:
        _resume(meta)
    assert err.value.code == "bad_meta"
