"""Flags shared by the two inference instances (prefill and decode): the model, its KV cache, and
registering with the conductor. ``runner.py`` builds what they describe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mooncake_kernels.kv_codec import CODEC_NAMES, fp8_supported
from mooncake_lite.common.config import option, require
from mooncake_lite.common.membership import Conductor, conductor_urls
from mooncake_lite.common.roles import RoleConfig
from mooncake_lite.common.units import parse_duration, parse_size
from mooncake_lite.model.args import DTYPES, dtype_choice
from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.model.kv_codec import model_codec
from mooncake_lite.model.source import DEFAULT_MODEL, model_id
from mooncake_lite.model.tensor_parallel import check_divides


# --weights auto: what a role holds. A prefill's forwards are compute-bound and wide, where a
# float copy's F.linear beats the blocks (docs/model.md, "CPU paths"); a decode's few rows are
# bound by memory, where the blocks' bytes are the speed.
HYBRID_MEMORY_SHARE = 8   # the float copy may take at most 1/8 of the memory available


def weights_choice(mode: str, role_auto: str, dense_bytes: int, available: int) -> tuple[str, str]:
    """(--weights as served, why) for ``mode``: ``auto`` is ``role_auto`` (the role's), hybrid only
    where its float32 copy of ``dense_bytes`` fits 1/``HYBRID_MEMORY_SHARE`` of ``available``."""
    if mode != "auto":
        return mode, f"--weights {mode}"
    if role_auto != "hybrid":
        return role_auto, f"--weights auto: {role_auto} on this role"
    mib = 1 << 20
    if dense_bytes * HYBRID_MEMORY_SHARE <= available:
        return "hybrid", (f"--weights auto on a prefill: a {dense_bytes // mib} MiB float copy for its wide products, "
                          f"within 1/{HYBRID_MEMORY_SHARE} of the {available // mib} MiB available")
    return "quantized", (f"--weights auto on a prefill: a {dense_bytes // mib} MiB float copy is over "
                         f"1/{HYBRID_MEMORY_SHARE} of the {available // mib} MiB available")


def optional_duration(value):
    return None if value in (None, "", "none") else parse_duration(value)


def parse_cpus(value) -> tuple[int, ...] | None:
    """``"0,2-3"`` → (0, 2, 3), as taskset and /proc's Cpus_allowed_list write CPU lists."""
    if value in (None, "", "all"):
        return None
    if isinstance(value, (tuple, list)):
        return tuple(sorted({int(v) for v in value}))
    cpus: set[int] = set()
    for part in str(value).split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


@dataclass(frozen=True)
class ModelRoleConfig(RoleConfig):
    dtype_reason: ClassVar[str] = "asked for"   # why the dtype: --dtype auto's choice sets its own
    AUTO_WEIGHTS: ClassVar[str] = "quantized"    # what --weights auto holds on this role
    model: str = option(DEFAULT_MODEL, "model: a named real model (smollm2-135m), a GGUF file, a Hugging "
                        "Face checkpoint directory, or a dummy-weight preset (tiny, small, llama2-7b, ...)")
    dtype: str = option("auto", "model and KV dtype ('auto': bfloat16 on CUDA, float32 elsewhere, said at start-up "
                        "with why)",
                        choices=sorted(DTYPES) + ["auto"])
    weights: str = option("auto", "a GGUF's Q4_0/Q4_1/Q8_0 weights kept as its blocks and computed on "
                          "(quantized; CPU float32), dequantized at load (dequantize), or both, the float copy "
                          "for prefill-sized products (hybrid); auto: hybrid on a prefill where the copy takes "
                          "at most 1/8 of the memory available, else quantized",
                          choices=("auto", "quantized", "dequantize", "hybrid"))
    device: str = option("cpu", "torch device (cpu, cuda, cuda:1)")
    gpu_memory_fraction: float = option(0.9, "on CUDA: share of the device's memory this instance may hold, "
                                        "weights, KV cache and activations together; the KV cache is what is left "
                                        "after the weights (--num-blocks overrides it; --kv-memory is the CPU's)")
    seed: int = option(0, "dummy-weight seed of presets; must be equal across the cluster")
    threads: int | None = option(None, "torch intra-op threads (default: torch's choice; `mooncake up` gives "
                                 "each instance its share of the cores)")
    cpus: tuple[int, ...] | None = option(None, "CPUs to run on, e.g. 0,1 or 2-3 (default: all this process may "
                                          "use; ignored where the OS has no affinity call)", parse=parse_cpus)
    num_blocks: int | None = option(None, "KV cache blocks (overrides --kv-memory)")
    kv_memory: int = option(256 << 20, "KV cache memory when --num-blocks is not given", parse=parse_size)
    port: int = option(0, "HTTP port (0 = pick a free one)")
    conductor: str | None = option(None, "conductor URL to register with, e.g. http://127.0.0.1:8000; several "
                                   "conductors: their URLs separated by commas (each gets every report)")
    instance_id: str | None = option(None, "instance id (default: ROLE@HOST:PORT)")
    heartbeat_interval: float = option(1.0, "seconds between heartbeats to the conductor", parse=parse_duration)
    profile: bool = option(True, "time a few model runs at startup and report the fitted cost model")
    tensor_parallel: int = option(1, "tensor-parallel ranks of this instance: N processes, rank 0 serving, each "
                                  "holding 1/N of the heads and MLP (gloo on CPU, NCCL on CUDA); --kv-memory is "
                                  "the instance's, split evenly among its ranks", aliases=("--tp",))
    tp_timeout: float = option(60.0, "seconds any tensor-parallel collective may wait before the whole instance "
                               "fails (the ranks' start-up meeting may take 300)", parse=parse_duration)
    moe_layout: str = option("split", "a mixture of experts at --tensor-parallel N: every expert split by width "
                             "over the ranks (split), or whole experts placed per rank, E/N each (placed: expert "
                             "parallelism); docs/model.md", choices=("split", "placed"))
    devices: tuple[int, ...] | None = option(None, "CUDA devices of the tensor-parallel ranks, one each, e.g. 0,1 "
                                             "(default: every rank on --device)", parse=parse_cpus)
    kv_compression: str = option("none", "KV blocks in the store (DRAM, SSD, its wire) as 1-byte codes with "
                                 "per-head scales, dequantized on load: none, int8, fp8 (e4m3); must equal "
                                 "the store's --kv-compression", choices=CODEC_NAMES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype == "auto":   # resolved once here: every reader sees a real dtype name
            dtype, why = dtype_choice(self.device, self.model)
            object.__setattr__(self, "dtype", dtype)
            object.__setattr__(self, "dtype_reason", f"--dtype auto: {why}")   # said at start-up
        require(0 < self.gpu_memory_fraction <= 1,
                f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        require(self.threads is None or self.threads > 0, f"--threads must be positive, got {self.threads}")
        require(self.cpus is None or (len(self.cpus) > 0 and min(self.cpus) >= 0), f"--cpus: bad list {self.cpus}")
        require(self.num_blocks is None or self.num_blocks > 0, f"--num-blocks must be positive, got {self.num_blocks}")
        require(self.kv_memory > 0, f"--kv-memory must be positive, got {self.kv_memory}")
        require(0 <= self.port < 65536, f"--port out of range: {self.port}")
        require(self.heartbeat_interval > 0, "--heartbeat-interval must be positive")
        try:
            conductor_urls(self.conductor)
        except ValueError as exc:
            require(False, str(exc))
        require(self.kv_compression != "fp8" or fp8_supported(),
                "--kv-compression fp8: this torch build cannot cast torch.float8_e4m3fn (use int8)")
        try:
            args = model_args(self.model)
        except (ValueError, OSError) as exc:
            require(False, f"--model: {exc}")
        try:   # an MLA cache's rope key takes a scale of its own, where it fits (model/kv_codec.py)
            model_codec(self.kv_compression, args)
        except ValueError as exc:
            require(False, f"--kv-compression {self.kv_compression} for {self.model}: {exc}")
        self._check_tensor_parallel(args)

    def _check_tensor_parallel(self, args) -> None:
        require(self.tp_timeout > 0, "--tp-timeout must be positive")
        require(self.moe_layout in ("split", "placed"), f"--moe-layout must be split or placed, got {self.moe_layout!r}")
        try:
            check_divides(args, self.tensor_parallel, self.expert_parallel)
        except ValueError as exc:
            require(False, f"--tensor-parallel: {exc}")
        if self.devices is not None:
            require(self.device.startswith("cuda"), "--devices names CUDA devices: give --device cuda too")
            require(len(self.devices) >= self.tensor_parallel,
                    f"--devices lists {len(self.devices)} devices for {self.tensor_parallel} ranks")

    @property
    def expert_parallel(self) -> bool:
        """Whole experts placed per tensor-parallel rank (``--moe-layout placed``)."""
        return self.moe_layout == "placed"

    def joins(self) -> Conductor | None:
        """The conductors this instance registers with and heartbeats to (None: it serves alone)."""
        if self.conductor is None and self.discovery is None:
            return None
        return Conductor(self.conductor or "", self.cluster_token, self.heartbeat_interval, self.discovery,
                         (("model", model_id(self.model)), ("block_size", self.block_size),
                          ("hash_seed", self.hash_seed)))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
