import pytest

from mooncake_lite.cluster.health import missing_instances, registered_counts
from mooncake_lite.cluster.plan import (UpOptions, conductor_spec, instance_specs, split_args, stop_order,
                                        store_specs)
from mooncake_lite.cluster.registration import connectable

LAUNCH = ("py", "-m", "mooncake_lite")


def opts(**kw):
    return UpOptions(launcher=LAUNCH, **kw)


def test_specs_wire_addresses_and_pass_through_flags():
    o = opts(num_prefill=2, num_decode=1, num_stores=2, model="small", common=("--block-size", "16"),
             role_args={"prefill": ("--chunk-size", "64")}, cluster_token="t", api_key="k")
    c = conductor_spec(o)
    assert c.argv[:5] == (*LAUNCH, "--role", "conductor") and "--block-size" in c.argv
    assert c.env == {"MOONCAKE_CLUSTER_TOKEN": "t", "MOONCAKE_API_KEY": "k"}
    assert "t" not in c.argv and "k" not in c.argv
    stores = store_specs(o, "http://127.0.0.1:9")
    assert [s.name for s in stores] == ["store-0", "store-1"]
    assert "MOONCAKE_API_KEY" not in stores[0].env
    inst = instance_specs(o, "http://127.0.0.1:9", ["127.0.0.1:1", "127.0.0.1:2"])
    assert [s.name for s in inst] == ["prefill-0", "prefill-1", "decode-0"]
    store_of = {s.name: s.argv[s.argv.index("--store") + 1] for s in inst}
    assert store_of == {"prefill-0": "127.0.0.1:1", "prefill-1": "127.0.0.1:2", "decode-0": "127.0.0.1:1"}
    assert inst[0].argv[-2:] == ("--chunk-size", "64") and "--chunk-size" not in inst[2].argv
    assert "--data-port" in inst[2].argv and "--data-port" not in inst[0].argv


def test_stop_order_is_conductor_then_instances_then_stores():
    names = ["conductor", "store-0", "prefill-0", "decode-0", "prefill-1"]
    assert stop_order(names) == [["conductor"], ["prefill-0", "decode-0", "prefill-1"], ["store-0"]]


@pytest.mark.parametrize("kw, needle", [({"num_prefill": 0}, "--prefill"), ({"port": 70000}, "--port"),
                                        ({"role_args": {"bogus": ()}}, "unknown role")])
def test_bad_options(kw, needle):
    with pytest.raises(ValueError, match=needle):
        opts(**kw)


def test_split_args_and_connectable():
    assert split_args("--a 1 --b 'x y'") == ("--a", "1", "--b", "x y") and split_args(None) == ()
    assert connectable("0.0.0.0:80") == "127.0.0.1:80" and connectable("10.0.0.2:80") == "10.0.0.2:80"


@pytest.mark.parametrize("body, want", [
    ({"instances": [{"role": "prefill"}, {"role": "decode"}, {"role": "decode", "alive": False}]},
     {"prefill": 1, "decode": 1}),
    ({"instances": {"p0": {"role": "prefill", "state": "alive"}, "d0": {"role": "decode", "state": "dead"}}},
     {"prefill": 1, "decode": 0}),
    ({"instances": {"prefill": [{"id": "a"}, {"id": "b"}], "decode": []}}, {"prefill": 2, "decode": 0}),
    ({"num_prefill": 3, "num_decode": 2}, {"prefill": 3, "decode": 2}),
    ({"prefills": ["a"], "decodes": {"x": {}}}, {"prefill": 1, "decode": 1}),
    ("not json", {"prefill": 0, "decode": 0}),
])
def test_registered_counts_reads_common_health_shapes(body, want):
    assert registered_counts(body) == want


def test_missing_instances():
    body = {"instances": [{"role": "prefill"}]}
    assert missing_instances(body, {"prefill": 1, "decode": 2}) == {"decode": 2}
    assert missing_instances({"num_prefill": 1, "num_decode": 2}, {"prefill": 1, "decode": 2}) == {}


def test_wiring_flags_a_role_lacks_are_left_out():
    fields = {"conductor": frozenset({"model", "port"}), "store": frozenset({"data_port"}),
              "prefill": frozenset({"conductor", "store", "model"}), "decode": frozenset({"conductor", "model"})}
    o = UpOptions(launcher=LAUNCH, role_fields=fields)
    assert "--conductor" not in store_specs(o, "http://c")[0].argv
    prefill, decode = instance_specs(o, "http://c", ["h:1"])
    assert "--store" in prefill.argv and "--store" not in decode.argv and "--data-port" not in decode.argv
    assert "--model" in conductor_spec(o).argv
