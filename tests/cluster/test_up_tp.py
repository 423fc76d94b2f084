"""``mooncake up --tp N`` makes every prefill and decode instance N ranks, and leaves the others be;
the memory plan counts each rank."""

import dataclasses

from mooncake_lite.cluster.plan import instance_share_flags, planned_memory, role_tp
from mooncake_lite.cluster.shares import PROCESS_OVERHEAD, MachineShare, memory_shares, rank_weight_bytes
from mooncake_lite.cluster.up import build_parser, options_from


def test_tp_reaches_every_inference_instance_and_their_own_flags_still_win():
    opts = options_from(build_parser().parse_args(["--tp", "3", "--dtype", "bfloat16",
                                                   "--decode-args", "--tp 1"]))
    assert opts.role_args["prefill"] == ("--dtype", "bfloat16", "--tensor-parallel", "3")
    assert opts.role_args["decode"] == ("--dtype", "bfloat16", "--tensor-parallel", "3", "--tp", "1")
    assert not any("--tensor-parallel" in opts.role_args[r] for r in ("conductor", "store"))


def test_the_memory_plan_counts_every_rank_and_gives_each_its_threads():
    """A TP=N instance is N processes: each holds the replicated weights whole and 1/N of the
    rest, with its own process overhead; its CPU share is split among its ranks (--threads is a
    rank's). ``--decode-args '--tp 1'`` still makes the decodes one process."""
    GiB = 1 << 30
    share = MachineShare(cpus=tuple(range(8)), available_memory=64 * GiB, weight_bytes=4 * GiB,
                         replicated_weight_bytes=1 * GiB)
    assert rank_weight_bytes(share, 1) == 4 * GiB and rank_weight_bytes(share, 3) == 2 * GiB
    one, three = memory_shares(share, 1, 1, 1), memory_shares(share, 1, 1, 1, decode_tp=3)
    # three ranks: 6 GiB of weights and three processes' overhead instead of 4 GiB and one
    fewer = sum(dataclasses.astuple(one)) - sum(dataclasses.astuple(three))
    assert abs(fewer - (2 * GiB + 2 * PROCESS_OVERHEAD)) <= 3
    opts = dataclasses.replace(options_from(build_parser().parse_args(["--tp", "3", "--decode-args", "--tp 1"])),
                               share=share)
    assert (role_tp(opts, "prefill"), role_tp(opts, "decode")) == (3, 1)
    flags = {role: dict(instance_share_flags(opts, role, f"{role}-0")) for role in ("prefill", "decode")}
    assert flags["prefill"]["--threads"] == "1" and flags["decode"]["--threads"] == "4"   # 4 CPUs each
    assert flags["decode"]["--kv-memory"] == str(planned_memory(opts, share).decode_kv)
