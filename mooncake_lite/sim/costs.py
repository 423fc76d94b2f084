"""Hardware cost presets for the simulator, and loading a live profile.

The simulator's "truth" uses the scheduler's own coefficient classes
(:class:`~mooncake_lite.scheduler.costs.PrefillCostModel`, ``DecodeCostModel``), so with
``noise=0`` the conductor predicts exactly what the simulated hardware then does.

``llama2-70b-a800`` (the paper's dummy model on 8×A800 nodes, docs/paper.md §5):
  * prefill: the FAST'25 FLOPs model ``l·(a·n²·d + b·n·d²)`` (a=4, b=22, l=80, d=8192) divided
    by one effective throughput, plus a fixed overhead, both fitted (relative least squares)
    to the measured TP8 batch-1 times 512→94 ms, 2k→274 ms, 8k→1,544 ms. The fit is within
    ±14% of those points (see :func:`calibration_table`); a free 3-parameter fit would pass
    through them exactly but makes attention 6× costlier than its FLOPs and 128k prompts
    take 212 s, which no FlashAttention-era system shows, so the FLOPs shape is kept.
    With a prefix of p tokens the n new tokens cost ``b·n·d²`` plus attention ``a·n·(p+n)·d``.
  * decode step: ``c0 + c1·batch + c2·context``: c0 = 44.8 ms (≈45 ms/token at small batch),
    c1 = 0.15 ms per sequence (2·70e9 FLOPs at the prefill's effective rate + sampling),
    c2 = KV bytes per token / (8 × 2.0 TB/s HBM × 0.6 achieved) ≈ 34 ns per context token.
  * KV 327,680 B/token; decode KV capacity (8×80 GB × 0.9 − 138 GB weights) ≈ 1.34 M tokens;
    DRAM 1 TB per node (≈ 4,770 blocks of 512 tokens at 80% usable);
    RDMA 800 Gbps at 90% = 90 GB/s between nodes; DRAM→GPU 8 × 25 GB/s PCIe for local prefix loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel, kv_bytes_per_token
from mooncake_lite.store.eviction import POLICY_NAMES

# FAST'25 FLOPs model constants for LLaMA2-70B (docs/paper.md §5).
LAYERS, HIDDEN, ATTN_A, MLP_B = 80, 8192, 4, 22
MEASURED_PREFILL_S = {512: 0.094, 2048: 0.274, 8192: 1.544}  # 8×A100 TP8, batch 1
# A profile's store keys (Hardware fields, written by to_dict when set); a count past the bound
# (~8 PB of 786 KB slots) is a corrupt file, not a store.
STORE_KEYS = ("store_blocks_per_node", "ssd_blocks_per_node", "store_block_tokens", "eviction")
STATE_KEYS = ("prefill_idle", "prefill_busy")   # a prefill's true speed by node state: both or neither
MAX_STORE_BLOCKS = 10**10


@dataclass(frozen=True)
class Hardware:
    """Everything the simulator needs to know about one node type and the network."""

    name: str
    prefill: PrefillCostModel
    decode: DecodeCostModel
    kv_bytes_per_token: int
    network_bytes_per_s: float          # between nodes (KV fetch, prefill→decode stream)
    local_load_bytes_per_s: float       # store DRAM → GPU of the same node
    decode_max_context_tokens: int | None
    dram_bytes_per_node: int
    dram_usable_fraction: float = 0.8
    block_size: int = 512
    ssd_load_bytes_per_s: float = 8 * 3e9   # 8 NVMe drives × ~3 GB/s (SSD tier → GPU)
    # Bytes of a stored block over its bytes in the model dtype (--kv-compression: ~0.5 for int8
    # codes of fp16 KV). Store capacity, store→store fetches and prefix loads shrink by it; the
    # prefill→decode stream stays in the model dtype, as the scheduler's estimates do.
    store_kv_factor: float = 1.0
    # A decode step's measured time over its model's prediction, as equal-mass quantiles (a
    # live cluster's export, conductor/cost_export.py); empty: every step takes the model's time.
    decode_step_ratios: tuple[float, ...] = ()
    # A decode step's time while a prefill computes beside it over its time alone, measured on
    # a one-box cluster (conductor/cost_export.py: prefill and decode share its CPU). 1.0: the
    # nodes do not interfere (the paper's). Else the simulated cluster is that one box: every
    # decode's steps take this much longer while any prefill computes (sim/cluster.py).
    decode_colocated_slowdown: float = 1.0
    # The spread of steps run beside a computing prefill (as decode_step_ratios, which then spread
    # only those run alone): a step timed while one computes draws its shape from it (sim/batch.py).
    decode_busy_step_ratios: tuple[float, ...] = ()
    # Seconds a padding token adds to a decode step: a CPU decode's attention (the torch
    # reference kernel, kernels/attention.py) runs every sequence of a batch to the longest
    # one's context, batch × longest − context tokens more (instance/colocation.padded_step;
    # measured by the live export). 0: attention as long as the contexts (a GPU's kernel).
    decode_padding_s_per_token: float = 0.0
    # Seconds per prompt token the decode's model thread spends writing a received prompt's KV
    # into its cache, frame by frame as the prefill streams it: its steps stretch over that prefill.
    decode_kv_write_s_per_token: float = 0.0
    # A live store's capacity (conductor/cost_export.py): DRAM slots and SSD blocks per node, each
    # block of ``store_block_tokens`` tokens (None: ``block_size``), and its eviction policy. None:
    # the store is sized from ``dram_bytes_per_node`` with no SSD tier, and evicts as configured.
    store_blocks_per_node: int | None = None
    ssd_blocks_per_node: int | None = None
    store_block_tokens: int | None = None
    eviction: str | None = None
    # A prefill's true speed by its node's state at a forward's start, as a live cluster measured
    # each (conductor/cost_export.py: the live conductor's idle and busy corrections): busy when a
    # job is queued behind it or a decode has requests, idle otherwise. None: every forward runs at
    # ``prefill``, which stays the model the simulated conductor prices with.
    prefill_idle: PrefillCostModel | None = None
    prefill_busy: PrefillCostModel | None = None

    def block_bytes(self) -> int:
        """Bytes of one block as the store keeps (and moves) it."""
        return int(self.kv_bytes_per_token * self.store_kv_factor * self.block_size)

    def dram_blocks(self) -> int:
        """Blocks of ``block_size`` tokens one node's store can hold: as many tokens as a live
        store's slots, where the profile has them, else its DRAM's worth."""
        if self.store_blocks_per_node is not None:
            return self.store_blocks_per_node * (self.store_block_tokens or self.block_size) // self.block_size
        return int(self.dram_bytes_per_node * self.dram_usable_fraction // self.block_bytes())

    def ssd_blocks(self) -> int:
        """Blocks of ``block_size`` tokens one node's SSD tier holds (0: none)."""
        return (self.ssd_blocks_per_node or 0) * (self.store_block_tokens or self.block_size) // self.block_size

    def prefill_seconds(self, num_tokens: int, num_prefix_tokens: int) -> float:
        """True prefill time: compute, with the local prefix load hidden by layer-wise overlap
        unless it is the longer of the two (docs/paper.md §1)."""
        compute = self.prefill.predict(num_tokens, num_prefix_tokens)
        return max(compute, self.prefix_load_seconds(num_prefix_tokens))

    def prefix_load_seconds(self, num_prefix_tokens: int, from_ssd_tokens: int = 0) -> float:
        """Loading a reused prefix into the GPU: from the node's DRAM, except ``from_ssd_tokens``
        of it read from the SSD tier first (slower than the loads layer-wise prefill hides)."""
        from_ssd_tokens = min(from_ssd_tokens, num_prefix_tokens)
        per_token = self.kv_bytes_per_token * self.store_kv_factor
        return ((num_prefix_tokens - from_ssd_tokens) * per_token / self.local_load_bytes_per_s
                + from_ssd_tokens * per_token / self.ssd_load_bytes_per_s)

    def with_prefill_chunk(self, chunk: int) -> Hardware:
        """This hardware running a prompt of more than ``chunk`` uncached tokens chunk by chunk, as
        the live prefill does (its --prefill-chunk), its prefill model fitted per chunk as the live
        refiner fits it; every prefill time here and the scheduler's price of it then sum the chunks
        (``PrefillCostModel.with_chunk``; 0: one pass, as the paper presets' whole-prompt fits)."""
        return replace(self, prefill=self.prefill.with_chunk(chunk),
                       prefill_idle=self.prefill_idle and self.prefill_idle.with_chunk(chunk),
                       prefill_busy=self.prefill_busy and self.prefill_busy.with_chunk(chunk))

    def in_state(self, busy: bool) -> Hardware:
        """This hardware with its prefill's true speed in one node state (``prefill_idle``,
        ``prefill_busy``); itself where the profile has no states."""
        model = self.prefill_busy if busy else self.prefill_idle
        return self if model is None else replace(self, prefill=model, prefill_idle=None, prefill_busy=None)

    def with_kv_compression(self, codec: str, dtype_bytes: int = 2, head_dim: int = 128) -> Hardware:
        """This hardware with store blocks encoded by ``codec`` (kernels/kv_codec.py: 1-byte codes
        plus a 4-byte scale per ``block_size`` x ``head_dim`` codes of each K/V head and layer)."""
        if codec == "none":
            return self
        return replace(self, store_kv_factor=(1 + 4 / (self.block_size * head_dim)) / dtype_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "network_bytes_per_s": self.network_bytes_per_s,
                "local_load_bytes_per_s": self.local_load_bytes_per_s,
                "decode_max_context_tokens": self.decode_max_context_tokens,
                "dram_bytes_per_node": self.dram_bytes_per_node,
                "dram_usable_fraction": self.dram_usable_fraction, "block_size": self.block_size,
                "ssd_load_bytes_per_s": self.ssd_load_bytes_per_s,
                **({"decode_step_ratios": list(self.decode_step_ratios)} if self.decode_step_ratios else {}),
                **({"decode_busy_step_ratios": list(self.decode_busy_step_ratios)}
                   if self.decode_busy_step_ratios else {}),
                **({"decode_colocated_slowdown": self.decode_colocated_slowdown}
                   if self.decode_colocated_slowdown != 1.0 else {}),
                **({"decode_padding_s_per_token": self.decode_padding_s_per_token}
                   if self.decode_padding_s_per_token else {}),
                **({"decode_kv_write_s_per_token": self.decode_kv_write_s_per_token}
                   if self.decode_kv_write_s_per_token else {}),
                **{key: value for key in STORE_KEYS if (value := getattr(self, key)) is not None},
                **{key: model.to_dict() for key in STATE_KEYS if (model := getattr(self, key)) is not None}}


def _flops(n: float) -> float:
    return LAYERS * (ATTN_A * n * n * HIDDEN + MLP_B * n * HIDDEN * HIDDEN)


def fit_flops_prefill(measured: dict[int, float]) -> tuple[float, float]:
    """(overhead_s, seconds_per_flop) minimising the relative error over ``measured``."""
    # Weighted normal equations for t ≈ c0 + k·flops with weights 1/t (relative error).
    rows = [(1.0 / t, _flops(n) / t) for n, t in measured.items()]
    s00 = sum(a * a for a, _ in rows); s01 = sum(a * b for a, b in rows); s11 = sum(b * b for _, b in rows)
    y0 = sum(a for a, _ in rows); y1 = sum(b for _, b in rows)   # targets are t/t = 1
    det = s00 * s11 - s01 * s01
    return (y0 * s11 - y1 * s01) / det, (s00 * y1 - s01 * y0) / det


def llama2_70b_a800() -> Hardware:
    overhead, per_flop = fit_flops_prefill(MEASURED_PREFILL_S)
    prefill = PrefillCostModel(c0=overhead, c1=per_flop * LAYERS * MLP_B * HIDDEN * HIDDEN,
                               c2=per_flop * LAYERS * ATTN_A * HIDDEN, c3=0.0)
    kvb = kv_bytes_per_token(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    hbm = 8 * 2.0e12 * 0.6
    decode = DecodeCostModel(c0=0.0448, c1=1.5e-4, c2=kvb / hbm)
    max_ctx = int((8 * 80e9 * 0.9 - 138e9) // kvb)
    return Hardware(name="llama2-70b-a800", prefill=prefill, decode=decode, kv_bytes_per_token=kvb,
                    network_bytes_per_s=800e9 / 8 * 0.9, local_load_bytes_per_s=8 * 25e9,
                    decode_max_context_tokens=max_ctx, dram_bytes_per_node=10**12)


PRESETS = {"llama2-70b-a800": llama2_70b_a800}


def calibration_table(hw: Hardware) -> list[dict[str, float]]:
    """Measured vs modelled prefill time at the calibration points."""
    return [{"tokens": n, "measured_s": t, "model_s": hw.prefill.predict(n, 0),
             "error": hw.prefill.predict(n, 0) / t - 1} for n, t in MEASURED_PREFILL_S.items()]


def load_profile(path: str | Path, base: Hardware | None = None) -> Hardware:
    """Hardware from a live-profile JSON (``mooncake bench pd --profile out.json``, or a running
    cluster's own models: ``mooncake sim export-costs``, whose extra keys — ``instances``,
    ``network_bytes_per_s_measured`` — are for the reader and ignored here).

    Format (all but ``prefill`` optional; missing fields come from ``base``, default the
    A800 preset). ``block_size`` is accepted but not applied: the simulator's block is the
    trace's hash-id granularity (512 tokens for Mooncake traces), not the live paging unit::

        {"name": "...", "prefill": {"c0":..,"c1":..,"c2":..,"c3":..},
         "decode": {"c0":..,"c1":..,"c2":..}, "kv_bytes_per_token": 327680,
         "bandwidth_bytes_per_s": 9e10,            # or "network_bytes_per_s"
         "local_load_bytes_per_s": 2e11, "decode_max_context_tokens": 1000000,
         "dram_bytes_per_node": 1e12, "block_size": 512,
         "decode_step_ratios": [0.9, .., 1.6],    # a step's spread around the decode model
         "decode_colocated_slowdown": 1.8,        # steps beside a computing prefill (one box)
         "decode_busy_step_ratios": [0.9, .., 1.9],   # and their spread
         "decode_padding_s_per_token": 2e-6,      # attention runs a batch to its longest context
         "store_blocks_per_node": 2465, "ssd_blocks_per_node": 0,   # a live store's slots, in
         "eviction": "lru",                        # blocks of store_block_tokens (or block_size)
         "prefill_idle": {..}, "prefill_busy": {..}}   # the true prefill by node state (both or neither)
    """
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"cannot read cost profile {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("prefill"), dict):
        raise ValueError(f"cost profile {path}: expected an object with a 'prefill' coefficient dict")
    hw = base or llama2_70b_a800()
    changes: dict[str, Any] = {"name": str(data.get("name", Path(path).stem)),
                               "prefill": PrefillCostModel.from_dict(data["prefill"])}
    if isinstance(data.get("decode"), dict):
        changes["decode"] = DecodeCostModel.from_dict(data["decode"])
    changes.update(_positive_numbers(path, data))
    for key in ("decode_step_ratios", "decode_busy_step_ratios"):
        if key in data:
            changes[key] = _step_ratios(path, key, data[key])
    changes.update(_store_capacity(path, data))
    if any(key in data for key in STATE_KEYS):
        if not all(isinstance(data.get(key), dict) for key in STATE_KEYS):
            raise ValueError(f"cost profile {path}: {' and '.join(STATE_KEYS)} come together, each a "
                             "prefill coefficient dict")
        changes.update({key: PrefillCostModel.from_dict(data[key]) for key in STATE_KEYS})
    return replace(hw, **changes)


def _store_capacity(path: str | Path, data: dict[str, Any]) -> dict[str, int | str]:
    """A profile's store keys, by Hardware field: block counts are integers in [0, MAX_STORE_BLOCKS]
    of ``store_block_tokens`` tokens (default the profile's ``block_size``), the policy a known one."""
    changes: dict[str, int | str] = {}
    for key in ("store_blocks_per_node", "ssd_blocks_per_node"):
        value = data.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STORE_BLOCKS:
                raise ValueError(f"cost profile {path}: {key} must be a whole number of blocks in "
                                 f"[0, {MAX_STORE_BLOCKS}], got {value!r}")
            changes[key] = value
    tokens = data.get("store_block_tokens", data.get("block_size"))
    if changes and tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"cost profile {path}: store_block_tokens (else block_size) must be a positive "
                             f"whole number of tokens, got {tokens!r}")
        changes["store_block_tokens"] = tokens
    if data.get("eviction") is not None:
        if data["eviction"] not in POLICY_NAMES:
            raise ValueError(f"cost profile {path}: eviction must be one of {', '.join(POLICY_NAMES)}, "
                             f"got {data['eviction']!r}")
        changes["eviction"] = data["eviction"]
    return changes


def _positive_numbers(path: str | Path, data: dict[str, Any]) -> dict[str, float | int]:
    """A profile's optional numeric fields, by Hardware field (each a positive number)."""
    bw = data.get("network_bytes_per_s", data.get("bandwidth_bytes_per_s"))
    changes: dict[str, float | int] = {}
    for key, value in (("network_bytes_per_s", bw), ("kv_bytes_per_token", data.get("kv_bytes_per_token")),
                       ("local_load_bytes_per_s", data.get("local_load_bytes_per_s")),
                       ("ssd_load_bytes_per_s", data.get("ssd_load_bytes_per_s")),
                       ("decode_max_context_tokens", data.get("decode_max_context_tokens")),
                       ("dram_bytes_per_node", data.get("dram_bytes_per_node")),
                       ("decode_colocated_slowdown", data.get("decode_colocated_slowdown")),
                       ("decode_padding_s_per_token", data.get("decode_padding_s_per_token")),
                       ("decode_kv_write_s_per_token", data.get("decode_kv_write_s_per_token"))):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"cost profile {path}: {key} must be a positive number, got {value!r}")
            changes[key] = float(value) if key.endswith(("_per_s", "_slowdown", "_per_token")) else int(value)
    return changes


def _step_ratios(path: str | Path, key: str, value: Any) -> tuple[float, ...]:
    """A profile's ``decode_step_ratios`` (or busy ones): positive finite numbers in ascending order."""
    ok = isinstance(value, list) and value and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in value)
    if not ok or any(a > b for a, b in zip(value, value[1:])):
        raise ValueError(f"cost profile {path}: {key} must be a non-empty ascending list of "
                         f"positive numbers, got {value!r}")
    return tuple(float(v) for v in value)


def get_hardware(spec: str) -> Hardware:
    """A preset by name, or a profile JSON by path."""
    if spec in PRESETS:
        return PRESETS[spec]()
    if spec.endswith(".json") or Path(spec).exists():
        return load_profile(spec)
    raise ValueError(f"unknown cost model {spec!r}; use a preset ({', '.join(PRESETS)}) or a profile .json path")
