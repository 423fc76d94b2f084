from dataclasses import replace

import orjson
import pytest

from mooncake_lite.common.protocol import (MAX_KV_IN_S, MAX_LEFT_S, MAX_PACK_CAP, GenerateRequest, Heartbeat,
                                            InstanceLoad, PrefillRequest, ProtocolError, RunningPrefill, Sampling,
                                            dumps, loads)


def test_round_trip_nested():
    msg = PrefillRequest("r1", "t1", (1, 2, 3), "127.0.0.1:9", Sampling(max_tokens=4, seed=3), prefix_keys=("ab",))
    assert loads(PrefillRequest, dumps(msg)) == msg


def test_a_generate_request_says_when_its_kv_is_due():
    for kv_in_s in (None, 0.0, 2.5, MAX_KV_IN_S):
        msg = GenerateRequest("r1", "t1", 3, Sampling(), 30.0, kv_in_s)
        assert loads(GenerateRequest, dumps(msg)) == msg
    old = loads(GenerateRequest, b'{"request_id": "r", "transfer_id": "t", "prompt_len": 3, "sampling": {}}')
    assert old.kv_in_s is None                          # an older conductor's: joins now, as before
    assert loads(GenerateRequest, dumps(old).replace(b'"kv_in_s":null', b'"kv_in_s":7')).kv_in_s == 7.0
    for bad in (-1e-9, MAX_KV_IN_S * 2, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_in_s must be within"):
            GenerateRequest("r1", "t1", 3, Sampling(), 30.0, bad)


def test_a_prefill_request_carries_its_pack_cap_and_a_hostile_one_is_refused():
    msg = PrefillRequest("r1", "t1", (1, 2), "127.0.0.1:9", Sampling(), pack_cap=300)
    assert loads(PrefillRequest, dumps(msg)).pack_cap == 300
    old = orjson.loads(dumps(msg))
    del old["pack_cap"]                                 # an older conductor's: the budget alone, as before
    assert loads(PrefillRequest, orjson.dumps(old)).pack_cap == 0
    assert "pack_cap" not in orjson.loads(dumps(replace(msg, pack_cap=0)))   # what a prefill from before caps reads
    for bad in (b"-1", str(MAX_PACK_CAP + 1).encode(), b"1" + b"0" * 30, b"1.5", b'"300"', b"null", b"true"):
        with pytest.raises(ProtocolError):
            loads(PrefillRequest, orjson.dumps(old)[:-1] + b',"pack_cap":' + bad + b"}")


def test_a_prefill_request_says_where_it_was_placed_and_an_older_prefill_is_sent_none():
    msg = PrefillRequest("r1", "t1", (1, 2), "127.0.0.1:9", Sampling(), placed=7, placer="c0ffee01")
    back = loads(PrefillRequest, dumps(msg))
    assert (back.placed, back.placer) == (7, "c0ffee01")
    plain = orjson.loads(dumps(replace(msg, placed=0, placer="")))
    assert "placed" not in plain and "placer" not in plain        # what a prefill from before reads
    for bad in (b'"placed":-1', b'"placed":4611686018427387904', b'"placer":"' + b"x" * 65 + b'"', b'"placed":1.5'):
        with pytest.raises(ProtocolError):
            loads(PrefillRequest, dumps(msg)[:-1] + b"," + bad + b"}")


@pytest.mark.parametrize("raw, needle", [
    (b"{", "invalid JSON"),
    (b"[]", "expected a JSON object"),
    (b'{"request_id": "r"}', "missing field"),
    (b'{"request_id": 1, "transfer_id": "t", "prompt_len": 3, "sampling": {}}', "expected str"),
    (b'{"request_id": "r", "transfer_id": "t", "prompt_len": true, "sampling": {}}', "expected int"),
    (b'{"request_id": "r", "transfer_id": "t", "prompt_len": 3, "sampling": {}, "x": 1}', "unknown field"),
])
def test_malformed_messages_are_clear(raw, needle):
    with pytest.raises(ProtocolError, match=needle):
        loads(GenerateRequest, raw)


@pytest.mark.parametrize("ids, needle", [
    ("[1, true, 3]", "expected int, got bool"),
    ('[1, "2", 3]', "expected int, got str"),
    ("[1, 2.5]", "expected int, got float"),
    ("[1, null]", "expected int, got NoneType"),
])
def test_every_item_of_a_list_field_is_checked(ids, needle):
    raw = ('{"request_id": "r", "transfer_id": "t", "token_ids": %s, "decode_data": "127.0.0.1:9", '
           '"sampling": {"max_tokens": 2}}' % ids)
    with pytest.raises(ProtocolError, match=f"PrefillRequest.token_ids: {needle}"):
        loads(PrefillRequest, raw)
    ok = loads(PrefillRequest, raw.replace(ids, "[1, 2, 3]"))
    assert ok.token_ids == (1, 2, 3) and type(ok.token_ids) is tuple


def test_a_heartbeat_load_is_strict_and_leaves_out_what_is_not_reported():
    beat = Heartbeat("d0", InstanceLoad(num_running=2.0, free_blocks=10.0), None)
    assert dumps(beat) == b'{"instance_id":"d0","load":{"free_blocks":10.0,"num_running":2.0},"cost":null}'
    assert loads(Heartbeat, dumps(beat)) == beat
    assert loads(Heartbeat, b'{"instance_id": "d0", "load": {"num_running": 2}}').load.num_running == 2.0
    for load, why in (('{"num_runing": 2}', "unknown field"), ('{"num_running": "2"}', "expected float"),
                      ('[1]', "expected a JSON object")):
        with pytest.raises(ProtocolError, match=why):
            loads(Heartbeat, '{"instance_id": "d0", "load": %s}' % load)
    with pytest.raises(ProtocolError, match="missing field 'instance_id'"):
        loads(Heartbeat, '{"load": {}}')


def test_a_running_prefill_report_is_bounded_and_absent_unless_made():
    beat = Heartbeat("p0", running=RunningPrefill("r1", 1.25))
    assert loads(Heartbeat, dumps(beat)) == beat
    assert b"running" not in dumps(Heartbeat("p0"))     # an older conductor refuses a field it does not know
    for running, why in (('{"request_id": "r1", "left_s": NaN}', "invalid JSON"),
                         ('{"request_id": "r1", "left_s": 1e400}', "invalid JSON"),
                         ('{"request_id": "r1", "left_s": -0.5}', "left_s must be within"),
                         ('{"request_id": "r1", "left_s": %r}' % (2 * MAX_LEFT_S), "left_s must be within"),
                         ('{"request_id": "", "left_s": 1}', "request_id must have"),
                         ('{"request_id": "%s", "left_s": 1}' % ("x" * 300), "request_id must have"),
                         ('{"request_id": 7, "left_s": 1}', "expected str"),
                         ('{"left_s": 1}', "missing field")):
        with pytest.raises(ProtocolError, match=why):
            loads(Heartbeat, '{"instance_id": "p0", "running": %s}' % running)
    with pytest.raises(ValueError, match="left_s must be within"):       # the value itself, built in Python
        RunningPrefill("r1", float("nan"))
