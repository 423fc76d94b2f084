"""`mooncake up --device cuda` / `--gpus`: each instance gets its device and its share of it; the
CUDA defaults (bfloat16, KV sized from the device after the weights) hold without a GPU here."""

import pytest

from mooncake_lite.cluster.gpus import gpu_placement
from mooncake_lite.cluster.machine import packs_weights
from mooncake_lite.cluster.plan import UpOptions, instance_share_flags, instance_specs, kv_layout
from mooncake_lite.cluster.shares import MachineShare
from mooncake_lite.cluster.up import build_parser, gpu_list, options_from
from mooncake_lite.common.config import ConfigError, load_config
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.instance.device_memory import DeviceMemory, kv_bytes_on_device

LAUNCH = ("py", "-m", "mooncake_lite")
GiB = 1 << 30


def opts(**kw):
    return UpOptions(launcher=LAUNCH, model="tiny", **kw)


def flags_of(spec) -> dict[str, str]:
    argv = spec.argv
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def test_one_prefill_one_decode_on_two_gpus_get_one_each():
    specs = instance_specs(opts(gpus=(0, 1)), "http://127.0.0.1:9", ["127.0.0.1:1"])
    got = {s.name: (flags_of(s)["--device"], float(flags_of(s)["--gpu-memory-fraction"])) for s in specs}
    assert got == {"prefill-0": ("cuda:0", 0.9), "decode-0": ("cuda:1", 0.9)}


def test_instances_sharing_a_gpu_split_it_one_to_three():
    placed = gpu_placement((0,), 1, 1, 0.8)
    assert placed == {"prefill-0": (0, pytest.approx(0.2)), "decode-0": (0, pytest.approx(0.6))}
    placed = gpu_placement((3, 5), 2, 2)
    assert {n: g for n, (g, _) in placed.items()} == {"prefill-0": 3, "prefill-1": 5, "decode-0": 3, "decode-1": 5}
    for gpu in (3, 5):   # the fractions on one GPU never add up past the asked share
        assert sum(f for g, f in placed.values() if g == gpu) == pytest.approx(0.9)


def test_the_users_device_and_fraction_win_and_cpu_passes_neither():
    o = opts(gpus=(0,), role_args={"decode": ("--device", "cuda:7", "--gpu-memory-fraction", "0.5")})
    specs = {s.name: s.argv for s in instance_specs(o, "http://x:1", ["h:1"])}
    assert specs["decode-0"].count("--device") == 1 and specs["decode-0"][-3] == "cuda:7"
    assert specs["decode-0"].count("--gpu-memory-fraction") == 1
    assert "--device" not in instance_specs(opts(), "http://x:1", ["h:1"])[0].argv


def test_a_gpu_instance_gets_no_host_kv_memory_and_no_packed_copy():
    share = MachineShare(cpus=(0, 1, 2, 3), available_memory=64 * GiB, weight_bytes=GiB)
    gpu, cpu = opts(gpus=(0,), share=share), opts(share=share)
    assert "--kv-memory" not in dict(instance_share_flags(gpu, "decode", "decode-0"))
    assert "--kv-memory" in dict(instance_share_flags(cpu, "decode", "decode-0"))
    assert not packs_weights(opts(gpus=(0,), role_args={"decode": ("--dtype", "float32")}), "decode", "float32")
    assert packs_weights(cpu, "decode", "float32")


def test_cuda_defaults_to_bfloat16_in_the_role_and_in_the_store_sizing():
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16"), ("cuda:1", "bfloat16")):
        cfg = load_config(ModelRoleConfig, ["--device", device, "--model", "tiny"], prog="t", section="prefill", env={})
        assert cfg.dtype == dtype
    assert kv_layout(opts(gpus=(0,)))[1] == "bfloat16" and kv_layout(opts())[1] == "float32"
    assert kv_layout(opts(gpus=(0,), role_args={"prefill": ("--dtype", "float16")}))[1] == "float16"
    with pytest.raises(ConfigError, match="--gpu-memory-fraction"):
        load_config(ModelRoleConfig, ["--gpu-memory-fraction", "1.5", "--model", "tiny"], prog="t",
                    section="prefill", env={})


def test_up_flags():
    ns = build_parser().parse_args(["--gpus", "2,3", "--gpu-memory-fraction", "0.5", "--model", "tiny"])
    o = options_from(ns)
    assert (o.gpus, o.gpu_memory_fraction) == ((2, 3), 0.5)
    assert options_from(build_parser().parse_args(["--model", "tiny"])).gpus is None
    with pytest.raises(ValueError, match="--gpus"):
        gpu_list("cuda", "0,x")
    with pytest.raises(ValueError, match="--gpus"):
        opts(gpus=(0, 0))


@pytest.mark.parametrize("mem, fraction, want", [
    # one instance alone: 90% of 100 GiB less 16 GiB of weights less the 2 GiB reserve
    (DeviceMemory(total=100 * GiB, free=84 * GiB, held=16 * GiB), 0.9, 72 * GiB),
    # its share is small: the share decides
    (DeviceMemory(total=100 * GiB, free=84 * GiB, held=16 * GiB), 0.225, int(22.5 * GiB) - 18 * GiB),
    # another process holds most of the device: what is free decides
    (DeviceMemory(total=100 * GiB, free=10 * GiB, held=16 * GiB), 0.9, 8 * GiB),
    # weights past the share: nothing left (the runner then refuses with the flag named)
    (DeviceMemory(total=10 * GiB, free=9 * GiB, held=9 * GiB), 0.5, 0),
])
def test_kv_on_a_device_is_its_share_after_the_weights(mem, fraction, want):
    assert kv_bytes_on_device(mem, fraction) == want
    assert kv_bytes_on_device(mem, fraction, max_bytes=GiB) == min(want, GiB)


def test_a_device_share_that_holds_no_block_is_refused_naming_the_flag():
    from mooncake_lite.instance.runner import blocks_for
    cfg = load_config(ModelRoleConfig, ["--device", "cuda:0", "--model", "tiny"], prog="t", section="decode", env={})
    block = 2 * 4 * 2 * 16 * 2 * cfg.block_size          # tiny: 4 layers, 2 KV heads of 16, bfloat16
    assert blocks_for(cfg, 4, 2, 16, kv_memory=10 * block + 1) == 10
    with pytest.raises(ConfigError, match="--gpu-memory-fraction"):
        blocks_for(cfg, 4, 2, 16, kv_memory=0)
