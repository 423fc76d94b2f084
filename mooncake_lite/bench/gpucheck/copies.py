"""Block-sized host↔device copies against one large copy of the same bytes, in the same run.

    python -m mooncake_lite.bench.gpucheck.copies --device cuda --block-bytes 1572864 --num-blocks 64

KV moves between the store's host memory and the device block by block (``kernels/copies.py``);
the goal is that pinned copies of one block each still reach ≥ 80% of one large pinned copy's
speed. On a CPU both are plain memory copies (no pinned memory, nothing to compare with the link).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from mooncake_kernels.timing import best_seconds


def measure(device: str, block_bytes: int, num_blocks: int, repeats: int = 5) -> dict:
    on_cuda = torch.device(device).type == "cuda"
    host = torch.empty(block_bytes * num_blocks, dtype=torch.uint8, pin_memory=on_cuda)
    dev = torch.empty_like(host, device=device)
    pieces = [(dev[i * block_bytes:(i + 1) * block_bytes], host[i * block_bytes:(i + 1) * block_bytes])
              for i in range(num_blocks)]

    def blocks(to_device: bool) -> None:
        for d, h in pieces:
            (d.copy_(h, non_blocking=True) if to_device else h.copy_(d, non_blocking=True))

    out = {"block_bytes": block_bytes, "num_blocks": num_blocks, "pinned": on_cuda}
    for name, to_device in (("h2d", True), ("d2h", False)):
        one = best_seconds(lambda: (dev.copy_(host, non_blocking=True) if to_device
                                    else host.copy_(dev, non_blocking=True)), device, repeats, warmup=1)
        many = best_seconds(lambda: blocks(to_device), device, repeats, warmup=1)
        out[name] = {"one_copy_gbps": host.numel() / one / 1e9, "block_copies_gbps": host.numel() / many / 1e9,
                     "share": one / many}
    return out


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpucheck.copies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--num-blocks", type=int, default=64)
    ns = ap.parse_args(list(argv))
    sys.stdout.write(json.dumps(measure(ns.device, ns.block_bytes, ns.num_blocks)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
