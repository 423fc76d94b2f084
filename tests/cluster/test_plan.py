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


# --- stores sized for the served model's KV blocks ------------------------------------------------

def sized(env=None, **kw):
    from mooncake_lite.cluster.up import with_store_sizing
    return with_store_sizing(opts(**kw), env={} if env is None else env)


def store_flags(o):
    """The sizing flags ``mooncake up`` adds to a store's command line (the user's own are not counted)."""
    argv = store_specs(o, "http://c")[0].argv
    ours = argv[:len(argv) - len(o.role_args.get("store", ()))]          # role args come last
    flags = {}
    for i, arg in enumerate(ours[:-1]):
        if arg in ("--slot-bytes", "--dram", "--ssd-queue"):
            flags[arg] = ours[i + 1]
    return flags


MiB = 1 << 20


@pytest.mark.parametrize("kw, env, block_bytes, flags", [
    # tiny: 2 x 4 layers x 2 kv heads x 16 x 4 B = 1 KiB per token; slots round up to 64 KiB
    ({"model": "tiny", "common": ("--block-size", "16")}, {}, 16 << 10, {"--slot-bytes": str(64 << 10)}),
    ({"model": "tiny", "common": ("--block-size", "100")}, {}, 100 << 10, {"--slot-bytes": str(128 << 10)}),
    # llama3-8b bf16 at 512 tokens: 64 MiB blocks, and DRAM for 64 of them (4 GiB > the 1 GiB default)
    ({"model": "llama3-8b", "common": ("--block-size", "512"), "role_args": {"prefill": ("--dtype", "bfloat16")}},
     {}, 64 * MiB, {"--slot-bytes": str(64 * MiB), "--dram": str(4096 * MiB)}),
    # the prefill's own --block-size wins over the common one (it is later on its command line)
    ({"model": "llama3-8b", "common": ("--block-size", "512"), "role_args": {"prefill": ("--block-size=64",)}},
     {}, 16 * MiB, {"--slot-bytes": str(16 * MiB)}),
    # compressed KV (tiny: 4 layers x (2 x 16 tokens x 2 heads x 16 one-byte codes + 2 x 2 float32 scales))
    ({"model": "tiny", "common": ("--block-size", "16", "--kv-compression", "int8")}, {}, 4 * 1040,
     {"--slot-bytes": str(64 << 10)}),
    ({"model": "llama3-8b", "common": ("--block-size", "512")}, {"MOONCAKE_KV_COMPRESSION": "int8"},
     32 * (2 * 512 * 8 * 128 + 2 * 8 * 4), {"--slot-bytes": str(513 << 16), "--dram": str(64 * (513 << 16))}),
    # the environment the roles inherit
    ({"model": "tiny"}, {"MOONCAKE_BLOCK_SIZE": "32"}, 32 << 10, {"--slot-bytes": str(64 << 10)}),
    # llama2-7b float32 at 512 tokens: 512 MiB slots also need a bigger SSD write queue
    ({"model": "llama2-7b", "common": ("--block-size", "512")}, {}, 512 * MiB,
     {"--slot-bytes": str(512 * MiB), "--dram": str(32768 * MiB), "--ssd-queue": str(1024 * MiB)}),
    # the user's own --slot-bytes is kept; --dram is sized from it
    ({"model": "llama3-8b", "common": ("--block-size", "512"), "role_args": {"store": ("--slot-bytes", "32MiB")}},
     {}, 128 * MiB, {"--dram": str(2048 * MiB)}),
    ({"model": "tiny"}, {"MOONCAKE_SLOT_BYTES": "1MiB"}, None, {}),
    ({"model": "llama3-8b", "role_args": {"store": ("--dram", "2GiB")}, "common": ("--block-size", "512")}, {},
     128 * MiB, {"--slot-bytes": str(128 * MiB)}),
    # a model this process cannot read: the stores keep their defaults, the roles will say what is wrong
    ({"model": "no-such-model"}, {}, None, {}),
])
def test_stores_are_sized_for_the_served_models_blocks(kw, env, block_bytes, flags):
    o = sized(env, **kw)
    if block_bytes is not None:
        assert o.kv_block_bytes == block_bytes
    assert store_flags(o) == flags


def test_sizing_reads_the_config_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cluster]\nblock_size = 16\n[prefill]\ndtype = "bfloat16"\n[store]\ndram = "8GiB"\n')
    o = sized(model="llama3-8b", config=str(cfg))
    assert o.kv_block_bytes == 16 * 128 << 10 and store_flags(o) == {"--slot-bytes": str(2 * MiB)}
    cfg.write_text('[store]\nslot_bytes = "1MiB"\n')
    assert store_flags(sized(model="llama3-8b", config=str(cfg), common=("--block-size", "16"))) == {}


def test_a_block_no_store_slot_can_hold_is_refused_up_front():
    with pytest.raises(ValueError, match="lower --block-size"):
        sized(model="llama2-7b", common=("--block-size", "2048"))       # 2 GiB blocks in float32


def test_sizing_without_a_known_block_passes_nothing():
    assert store_flags(opts(model="llama3-8b")) == {}


def test_the_sizing_flags_are_ones_the_store_accepts_and_defaults_agree():
    import dataclasses

    from mooncake_lite.cluster import plan
    from mooncake_lite.cluster.gpus import DEFAULT_GPU_MEMORY_FRACTION
    from mooncake_lite.common.config import load_config
    from mooncake_lite.instance.config import ModelRoleConfig
    from mooncake_lite.store.config import MAX_SLOT_BYTES, Config as StoreConfig
    defaults = {f.name: f.default for f in dataclasses.fields(StoreConfig)}
    assert (plan.STORE_DRAM, plan.STORE_SSD_QUEUE, plan.MAX_SLOT_BYTES) == (
        defaults["dram"], defaults["ssd_queue"], MAX_SLOT_BYTES)
    assert {f.name: f.default for f in dataclasses.fields(ModelRoleConfig)}["gpu_memory_fraction"] == \
        DEFAULT_GPU_MEMORY_FRACTION
    o = sized(model="llama2-7b", common=("--block-size", "512"))
    argv = [a for pair in store_flags(o).items() for a in pair]
    cfg = load_config(StoreConfig, argv, prog="t", section="store", env={})
    assert cfg.slot_bytes == o.kv_block_bytes and cfg.dram == 64 * cfg.slot_bytes


def test_sizing_flags_follow_the_wiring_rule():
    fields = {"conductor": frozenset(), "store": frozenset({"data_port"}), "prefill": frozenset(),
              "decode": frozenset()}
    o = sized(model="llama3-8b", common=("--block-size", "512"))
    assert store_flags(o)
    assert store_flags(UpOptions(**{**o.__dict__, "role_fields": fields})) == {}


def test_the_slot_table_in_the_example_config_is_right():
    import re
    from pathlib import Path

    from mooncake_lite.cluster.plan import slot_bytes_for
    from mooncake_lite.common.units import parse_size
    from mooncake_lite.model.checkpoint_config import model_args
    text = (Path(__file__).resolve().parents[2] / "docs" / "config.example.toml").read_text()
    row = re.compile(r"#\s+(\S+)\s+(\d+) x (\d+) x (\d+)\s+([\d.]+ \w+)\s+/ \"(\w+)\"\s+([\d.]+ \w+)\s+/ \"(\w+)\"")
    rows = [m.groups() for m in map(row.match, text.splitlines()) if m]
    assert {r[0] for r in rows} >= {"tiny", "small", "smollm2-135m", "llama2-7b", "llama3-8b"}
    for name, layers, kv_heads, head_dim, *cells in rows:
        args = model_args(name)
        assert (args.num_layers, args.num_kv_heads, args.head_dim) == (int(layers), int(kv_heads), int(head_dim))
        for dtype, (block, slot) in zip(("float32", "bfloat16"), (cells[:2], cells[2:])):
            want = args.kv_block_bytes(64, dtype)
            assert parse_size(block.replace(" ", "")) == want and parse_size(slot) == slot_bytes_for(want), name


def test_up_starts_prefills_shortest_first_unless_told_otherwise():
    fields = {"prefill": frozenset({"queue_order"}), "decode": frozenset()}
    prefill, decode = instance_specs(UpOptions(launcher=LAUNCH, role_fields=fields), "http://c", ["h:1"])
    assert prefill.argv[-2:] == ("--queue-order", "shortest") and "--queue-order" not in decode.argv
    told = UpOptions(launcher=LAUNCH, role_fields=fields, role_args={"prefill": ("--queue-order", "fifo")})
    prefill, _ = instance_specs(told, "http://c", ["h:1"])
    assert prefill.argv.count("--queue-order") == 1 and prefill.argv[-1] == "fifo"


def test_up_dtype_goes_to_the_prefills_and_decodes_and_their_own_flag_wins():
    from mooncake_lite.cluster.plan import kv_layout, role_setting
    from mooncake_lite.cluster.up import build_parser, options_from
    o = options_from(build_parser().parse_args(["--dtype", "bfloat16", "--decode-args", "--max-batch-size 4"]))
    assert role_setting(o, "prefill", "dtype") == role_setting(o, "decode", "dtype") == "bfloat16"
    assert role_setting(o, "store", "dtype") is None and role_setting(o, "conductor", "dtype") is None
    assert kv_layout(o)[1] == "bfloat16"              # the stores are sized for bfloat16 blocks
    mine = options_from(build_parser().parse_args(["--dtype", "bfloat16", "--prefill-args", "--dtype float32"]))
    assert role_setting(mine, "prefill", "dtype") == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "int3"])


def test_up_help_names_every_option_and_no_empty_default():
    """``mooncake up --help``: each option says what it is, and no "(default: None)" follows a help
    that already tells its default (``--dtype``, ``--restart`` said both)."""
    from mooncake_lite.cluster.up import build_parser
    p = build_parser()
    text = p.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert all(a.help for a in p._actions), [a.dest for a in p._actions if not a.help]
    assert "(default: 8000)" in text   # a default that says something is still shown
