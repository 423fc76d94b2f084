"""``mooncake up --tp N`` makes every prefill and decode instance N ranks, and leaves the others be."""

from mooncake_lite.cluster.up import build_parser, options_from


def test_tp_reaches_every_inference_instance_and_their_own_flags_still_win():
    opts = options_from(build_parser().parse_args(["--tp", "3", "--dtype", "bfloat16",
                                                   "--decode-args", "--tp 1"]))
    assert opts.role_args["prefill"] == ("--dtype", "bfloat16", "--tensor-parallel", "3")
    assert opts.role_args["decode"] == ("--dtype", "bfloat16", "--tensor-parallel", "3", "--tp", "1")
    assert not any("--tensor-parallel" in opts.role_args[r] for r in ("conductor", "store"))
