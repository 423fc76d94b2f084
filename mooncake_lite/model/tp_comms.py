"""A tensor-parallel group's collectives: gloo between CPU ranks, NCCL between GPU ranks.

Every collective runs under the group's timeout (``init_process_group``'s, which gloo applies to
each operation and NCCL's watchdog enforces): a rank that dies or hangs makes the others' next
collective fail with an error instead of waiting forever, and the instance restarts whole.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0 of a group listens for the others (its TCP store), and the group's shape."""
    host: str
    port: int
    size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str = "gloo"      # backend_for(the ranks' devices)
    # How long the ranks may take to meet: each loads its weights first, a slow disk or a busy
    # CPU taking longer than any one step should.
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be at least 1, got {self.size}")
        if self.timeout_s <= 0:
            raise ValueError(f"collective timeout must be positive, got {self.timeout_s}")


def backend_for(devices: Sequence[str | torch.device]) -> str:
    """NCCL between ranks on CUDA devices of their own; gloo on CPUs, and between ranks that
    share one GPU (NCCL refuses two ranks on one device: the one-GPU functional check)."""
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    distinct = len({d.index or 0 for d in cuda}) == len(devices)
    return "nccl" if cuda and len(cuda) == len(devices) and distinct else "gloo"


class TPComms:
    """Rank ``rank`` of a group: the :class:`~mooncake_lite.model.llama.Collectives` a sharded
    model uses, and the broadcasts its driver uses to hand every rank the same step. A model can
    be built on it before :meth:`join` (each rank loads its weights, then they meet)."""

    def __init__(self, address: GroupAddress, rank: int, device: str | torch.device = "cpu"):
        self.address, self.size, self.rank = address, address.size, rank
        self.timeout = datetime.timedelta(seconds=address.timeout_s)
        self.device = torch.device(device)
        self.group = None

    def join(self) -> "TPComms":
        """Meet the other ranks (waiting at most the group's timeout for the last one)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        a = self.address
        dist.init_process_group(a.backend, init_method=f"tcp://{a.host}:{a.port}", rank=self.rank,
                                world_size=a.size, timeout=datetime.timedelta(seconds=a.start_timeout_s))
        self.group = dist.new_group(list(range(a.size)), timeout=self.timeout)   # the steps' timeout
        return self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.all_gather(logits), dim=-1)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on each), in rank order, on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def broadcast_bytes(self, payload: bytes | None, src: int = 0) -> bytes:
        """Rank ``src``'s ``payload`` on every rank (the others pass None): a length, then the bytes."""
        mine = self.rank == src
        length = torch.tensor([len(payload) if mine else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=src, group=self.group)
        n = int(length.item())
        if n == 0:
            return b""
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if mine
               else torch.empty(n, dtype=torch.uint8, device=self.device))
        dist.broadcast(buf, src=src, group=self.group)
        return payload if mine else bytes(buf.cpu().numpy())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
