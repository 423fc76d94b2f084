"""``mooncake up`` divides one machine among its roles: CPU slices per instance, and KV / DRAM
memory from a fraction of what is available (shares.core_shares, shares.memory_shares), and a real
child runs with what it was given."""

import dataclasses
import os
import re
import subprocess

import pytest

from mooncake_lite.cluster import machine, shares
from mooncake_lite.cluster.machine import available_memory, usable_cpus, with_machine_share
from mooncake_lite.cluster.plan import UpOptions, instance_specs, store_specs
from mooncake_lite.cluster.shares import MachineShare, core_shares, lent_cpus, memory_shares
from mooncake_lite.cluster.registration import with_role_support
from mooncake_lite.common.config import load_config
from mooncake_lite.common.launch import LAUNCHER
from mooncake_lite.model.checkpoint_config import model_args
from tests.cluster.helpers import up_command

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("ncpu, prefill, decode, want", [
    (2, 1, 1, {"prefill-0": (0,), "decode-0": (1,)}),
    (8, 1, 1, {"prefill-0": (0, 1, 2, 3), "decode-0": (4, 5, 6, 7)}),
    (5, 2, 1, {"prefill-0": (0, 1), "prefill-1": (2, 3), "decode-0": (4,)}),     # spare CPUs to prefill
    (1, 1, 1, {"prefill-0": (0,), "decode-0": (0,)}),                            # fewer CPUs: shared
    (2, 2, 2, {"prefill-0": (0,), "prefill-1": (1,), "decode-0": (0,), "decode-1": (1,)}),
])
def test_core_shares(ncpu, prefill, decode, want):
    assert core_shares(range(ncpu), prefill, decode) == want


@pytest.mark.parametrize("cpus", [(0, 1, 2), (3, 5, 8, 9, 12), tuple(range(16))])
@pytest.mark.parametrize("prefill, decode", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_core_shares_are_disjoint_and_cover_the_machine(cpus, prefill, decode):
    shares = core_shares(cpus, prefill, decode)
    assert len(shares) == prefill + decode and all(shares.values())
    used = [c for s in shares.values() for c in s]
    if len(cpus) >= prefill + decode:
        assert sorted(used) == sorted(cpus)                          # every CPU once
    else:
        assert set(used) == set(cpus) and all(len(s) == 1 for s in shares.values())


@pytest.mark.parametrize("ncpu, prefill, decode, want", [
    (2, 1, 1, {"prefill-0": 1}),                          # the decode's CPU, while it leaves it idle
    (8, 1, 1, {"prefill-0": 4}),
    (5, 2, 1, {"prefill-0": 1, "prefill-1": 0}),          # one decode CPU: lent to one prefill
    (6, 1, 2, {"prefill-0": 4}),
    (1, 1, 1, {"prefill-0": 0}),                          # fewer CPUs than instances: nothing to lend
    (2, 2, 2, {"prefill-0": 0, "prefill-1": 0}),
])
def test_prefills_may_borrow_the_decodes_cpus(ncpu, prefill, decode, want):
    assert lent_cpus(range(ncpu), prefill, decode) == want


def smollm(available=32 * GiB, fraction=0.25, **kw):
    a = model_args("tiny" if kw.pop("tiny", False) else "smollm2-135m")
    return MachineShare(cpus=(0, 1), available_memory=available, memory_fraction=fraction,
                        weight_bytes=a.num_params() * 4, kv_token_bytes=a.kv_bytes_per_token("float32"),
                        max_seq_len=a.max_seq_len, **kw)


def test_memory_shares_split_what_is_left_after_weights():
    share = smollm()
    m = memory_shares(share, 1, 1, 1)
    budget = int(32 * GiB * 0.25) - 2 * (share.weight_bytes + shares.PROCESS_OVERHEAD)
    assert m.prefill_kv + m.decode_kv + m.store_dram <= budget
    assert m.decode_kv > m.store_dram > m.prefill_kv > shares.INSTANCE_KV_MEMORY
    # the load: decode's default 256 MiB held eleven 512-token blocks of this model
    per_block = model_args("smollm2-135m").kv_block_bytes(512, "float32")
    assert shares.INSTANCE_KV_MEMORY // per_block == 11 and m.decode_kv // per_block >= 40
    more = memory_shares(dataclasses.replace(share, memory_fraction=0.5), 1, 1, 1)
    assert more.decode_kv > m.decode_kv and more.store_dram > m.store_dram
    two = memory_shares(share, 1, 2, 2)                              # divided among instances
    assert two.decode_kv < m.decode_kv and two.store_dram < m.store_dram


def test_a_decodes_packed_weights_come_out_of_the_budget():
    share = smollm()                                   # no share at a floor or a cap
    packed = dataclasses.replace(share, decode_pack_bytes=share.weight_bytes)
    plain, two_copies = memory_shares(share, 1, 1, 1), memory_shares(packed, 1, 1, 1)
    assert two_copies.decode_kv < plain.decode_kv
    lost = (plain.prefill_kv + plain.decode_kv + plain.store_dram) - (
        two_copies.prefill_kv + two_copies.decode_kv + two_copies.store_dram)
    assert abs(lost - share.weight_bytes) < 1024      # one copy, taken from the shares it was split among
    both = dataclasses.replace(packed, prefill_pack_bytes=share.weight_bytes)
    assert sum(dataclasses.astuple(memory_shares(both, 1, 1, 1))) < sum(dataclasses.astuple(two_copies))
    opts = UpOptions(launcher=LAUNCHER, model="smollm2-135m")
    for role in ("decode", "prefill"):
        assert machine.packs_weights(opts, role, "float32") and not machine.packs_weights(opts, role, "bfloat16")
        on_gpu = dataclasses.replace(opts, role_args={role: ("--device", "cuda")})
        assert not machine.packs_weights(on_gpu, role, "float32")
    plain_prefill = dataclasses.replace(opts, role_args={"prefill": ("--pack-weights", "off")})
    assert not machine.packs_weights(plain_prefill, "prefill", "float32")
    assert machine.packs_weights(plain_prefill, "decode", "float32")


def test_memory_shares_never_fall_below_the_roles_defaults_and_small_models_are_capped():
    m = memory_shares(smollm(available=1 * GiB), 1, 1, 1)           # weights alone exceed the budget
    assert (m.prefill_kv, m.decode_kv, m.store_dram) == (shares.INSTANCE_KV_MEMORY, shares.INSTANCE_KV_MEMORY,
                                                          shares.STORE_DRAM)
    tiny = smollm(available=64 * GiB, tiny=True)                     # 1 KiB/token, 4096 tokens
    m = memory_shares(tiny, 1, 1, 1)
    seq = 4096 * 1024
    assert m.prefill_kv == max(shares.PREFILL_SEQUENCES * seq, shares.INSTANCE_KV_MEMORY)
    assert m.decode_kv == shares.DECODE_SEQUENCES * seq and m.store_dram == shares.STORE_SEQUENCES * seq
    unknown = dataclasses.replace(tiny, kv_token_bytes=None)         # shape unknown: no caps
    assert memory_shares(unknown, 1, 1, 1).decode_kv > 5 * GiB


@pytest.mark.parametrize("bad", [{"memory_fraction": 0}, {"memory_fraction": 1.5}, {"cpus": ()}, {"threads": 0}])
def test_bad_shares(bad):
    with pytest.raises(ValueError):
        MachineShare(**{"cpus": (0,), "available_memory": GiB, **bad})


def planned(share=None, **kw):
    return with_role_support(UpOptions(launcher=LAUNCHER, model="smollm2-135m", share=share or smollm(), **kw))


def flags_of(spec):
    argv = spec.argv
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1])
            if a in ("--threads", "--cpus", "--kv-memory", "--borrow-threads")}


def test_instances_get_their_share_as_flags_the_roles_accept():
    from mooncake_lite.decode.config import Config as DecodeConfig
    from mooncake_lite.prefill.config import Config as PrefillConfig
    o = planned()
    prefill, decode = instance_specs(o, "http://c", ["h:1"])
    m = memory_shares(o.share, 1, 1, 1)
    # not pinned: a thread each, and the prefill may borrow the decode's CPU while it is idle
    assert flags_of(prefill) == {"--threads": "1", "--borrow-threads": "1", "--kv-memory": str(m.prefill_kv)}
    assert flags_of(decode) == {"--threads": "1", "--kv-memory": str(m.decode_kv)}
    cfg = load_config(PrefillConfig, [a for pair in flags_of(prefill).items() for a in pair], prog="t",
                      section="prefill", env={})
    assert (cfg.threads, cfg.borrow_threads) == (1, 1)
    prefill, decode = instance_specs(planned(share=smollm(pin=True)), "http://c", ["h:1"])  # --pin: no borrowing
    assert flags_of(prefill)["--cpus"] == "0" and flags_of(decode)["--cpus"] == "1"
    for spec, config, role in ((prefill, PrefillConfig, "prefill"), (decode, DecodeConfig, "decode")):
        argv = [a for pair in flags_of(spec).items() for a in pair]
        cfg = load_config(config, argv, prog="t", section=role, env={})
        assert cfg.threads == 1 and len(cfg.cpus) == 1 and cfg.kv_memory == int(flags_of(spec)["--kv-memory"])


def test_what_the_user_set_wins():
    o = planned(share=smollm(pin=True), role_args={"decode": ("--threads", "2"), "prefill": ("--num-blocks=64",)})
    prefill, decode = instance_specs(o, "http://c", ["h:1"])
    assert flags_of(prefill).keys() == {"--threads", "--cpus"} and "--kv-memory" in flags_of(decode)
    assert decode.argv[-2:] == ("--threads", "2") and "--cpus" not in decode.argv
    unpinned = planned(share=smollm(threads=3, pin=True))           # `mooncake up --threads 3`: unpinned
    assert all(flags_of(s).get("--threads") == "3" and "--cpus" not in s.argv
               for s in instance_specs(unpinned, "http://c", ["h:1"]))
    kept = planned(role_args={"prefill": ("--borrow-threads", "0")})   # the user's borrowing, not ours
    assert instance_specs(kept, "http://c", ["h:1"])[0].argv.count("--borrow-threads") == 1
    # a custom launcher's roles may not take tuning flags: they get none
    custom = UpOptions(launcher=("py", "fake.py"), model="smollm2-135m", share=smollm())
    assert not any(flags_of(s) for s in instance_specs(custom, "http://c", ["h:1"]))


def test_no_share_keeps_every_default():
    o = with_role_support(UpOptions(launcher=LAUNCHER, model="smollm2-135m"))
    assert not any(flags_of(s) for s in instance_specs(o, "http://c", ["h:1"]))


def test_the_store_gets_its_dram_share():
    from mooncake_lite.cluster.up import with_store_sizing
    o = with_store_sizing(planned(), env={})
    argv = store_specs(o, "http://c")[0].argv
    assert argv[argv.index("--dram") + 1] == str(memory_shares(o.share, 1, 1, 1).store_dram)


def test_machine_facts_are_read_from_this_machine(tmp_path):
    assert set(usable_cpus()) <= set(range(os.cpu_count())) and usable_cpus()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert available_memory(str(meminfo)) == 2 * MiB and available_memory() > 0
    o = with_machine_share(UpOptions(launcher=LAUNCHER, model="smollm2-135m"), memory_fraction=0.3)
    a = model_args("smollm2-135m")
    # its Q4_1/Q8_0 weights stay compact (issue #39): the blocks' bytes, no packed head beside them
    assert 90e6 < o.share.weight_bytes < 100e6 and o.share.decode_pack_bytes == 0 and o.share.memory_fraction == 0.3
    assert o.share.prefill_pack_bytes == 4 * a.num_params()   # --weights auto: the prefill's float copy beside them
    o = with_machine_share(UpOptions(launcher=LAUNCHER, model="smollm2-135m", role_args={"prefill": ("--weights", "quantized")}))
    assert 90e6 < o.share.weight_bytes < 100e6 and o.share.prefill_pack_bytes == 0
    o = with_machine_share(UpOptions(launcher=LAUNCHER, model="smollm2-135m", common=("--weights", "dequantize")))
    assert o.share.weight_bytes == 4 * a.num_params() and o.share.decode_pack_bytes == a.packed_extra_bytes("float32")
    assert with_machine_share(UpOptions(launcher=LAUNCHER, model="no-such")).share.weight_bytes is None


@pytest.mark.timeout(240)
def test_a_real_up_child_runs_with_its_share():
    """`mooncake up --pin --smoke` with the real roles: each instance logs the torch threads and
    CPUs it actually has, and they are its plan's share."""
    proc = subprocess.run(up_command("--model", "tiny", "--pin", "--smoke", "--smoke-max-tokens", "1", fake=False),
                          capture_output=True, text=True, timeout=230, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {m.group(1): (int(m.group(2)), tuple(int(c) for c in m.group(3).split(",")))
           for m in re.finditer(r"\[(\w+-\d+)\].*torch threads (\d+) on cpus ([\d,]+);", proc.stderr)}
    want = core_shares(usable_cpus(), 1, 1)
    assert got == {name: (len(cpus), cpus) for name, cpus in want.items()}
