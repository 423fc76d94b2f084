"""Cost models the scheduler predicts with: prefill time, decode step time (TBT), KV transfer.

The coefficient dataclasses are fitted by least squares from measured samples (each prefill
instance profiles itself at startup; ``mooncake bench pd --profile`` saves them) and travel as
plain dicts (``to_dict``/``from_dict``) in registrations and heartbeats.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import numpy as np

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from mooncake_lite.scheduler.links import LinkSpeeds

T = TypeVar("T", bound="_Coefficients")
# ChunkedPrefillCostModel's default chunk (``with_chunk`` always sets one): longer than any prompt.
# One 30-bit digit, as every chunk is: CPython's comparison of two such ints stays specialized (1 << 61
# took the generic path: 1,100 instructions more a live decision, bin/decision-cost), and mypyc
# compares it inline as a short int.
UNCHUNKED = (1 << 30) - 1
# Fields of a model that are not coefficients: they stay where the model was made and never
# travel (an older peer's from_dict would refuse them as unknown). Not a class attribute: a
# ClassVar on these dataclasses is read as a field once mypyc compiles them.
LOCAL = frozenset({"chunk"})


class _Coefficients:
    """Shared dict round-trip with validation (a bad dict is a clear ValueError, never a crash later)."""

    # Slotted models keep their coefficients in the object itself: a decision reads one model
    # per instance, and a dict per model is three more cache lines each.
    __slots__ = ()

    def to_dict(self) -> dict[str, float]:
        # every subclass is a dataclass (this base has no fields of its own)
        # an optional coefficient (None: unset) does not travel, so an unset one reads anywhere
        return {k: float(v) for k, v in asdict(cast("DataclassInstance", self)).items()
                if k not in LOCAL and v is not None}

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        names = [f.name for f in fields(cast("type[DataclassInstance]", cls)) if f.name not in LOCAL]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown coefficient(s) {unknown}; expected {names}")
        values = {}
        for name in names:
            if name not in data:
                continue
            v = data[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                raise ValueError(f"{cls.__name__}.{name} must be a finite number, got {v!r}")
            values[name] = float(v)
        return cls(**values)


def _lstsq(rows: list[list[float]], targets: list[float], num_coef: int, what: str) -> list[float]:
    if len(rows) < num_coef:
        raise ValueError(f"{what}: need at least {num_coef} samples, got {len(rows)}")
    a = np.asarray(rows, dtype=np.float64)
    b = np.asarray(targets, dtype=np.float64)
    # Scale columns so the quadratic term (~1e8) and the constant (1) are equally conditioned.
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    coef, *_ = np.linalg.lstsq(a / scale, b, rcond=None)
    return [float(c) for c in coef / scale]


@dataclass(frozen=True, slots=True)
class PrefillCostModel(_Coefficients):
    """Prefill execution seconds for ``n`` new tokens on top of ``p`` reused prefix tokens:

    ``t = c0 + c1·n + c2·n·(p + n) + c3·p``

    c1 is the linear (MLP/projection) cost, c2 the attention cost of n queries over p + n keys,
    c3 any prefix-loading cost the layer-wise overlap does not hide (often ~0): the cached prefix
    is loaded once, by a prompt's first pass. An instance that said its chunk has a
    :class:`ChunkedPrefillCostModel` (:meth:`with_chunk`); a chunk after the first costs
    ``later_c0`` fixed (:meth:`chunk_after`).
    """

    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0
    c3: float = 0.0
    # The fixed cost of each chunk after a prompt's first (None: ``c0``; a one-pass model has none).
    # An instance measures it apart from the first's (instance/refine.py: the first chunk runs
    # beside the decode of the jobs before it, and takes in the request); a corrected model
    # raises only the first's: its line's offset is fitted once a request (costs.scaled, forward_fit.py).
    later_c0: float | None = None
    # Of ``c0``, what each job of a packed forward beyond the first still pays (its own KV frames,
    # begin, sampling and END; None: none): a pack shares ``shared_c0`` once. Timed at start-up by
    # a pack against its jobs alone (prefill/profiling.py); 0.03-0.045 s of a busy c0 of 0.108 s
    # on a 2-vCPU Xeon (docs/results/2026-12-04-xeon-2vcpu.md, "Packed forwards").
    member_c0: float | None = None

    @property
    def shared_c0(self) -> float:
        """The fixed cost a packed forward pays once for all its jobs (``packed_seconds``)."""
        m = self.member_c0
        if m is None or m <= 0.0:
            return self.c0
        return self.c0 - m if m < self.c0 else 0.0

    def predict(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        """Seconds to prefill a ``num_tokens`` prompt whose first ``num_prefix_tokens`` are cached:
        the prefill formula, written once (the wide rows, scheduler/wide.py, call it per model)."""
        # The last token is always computed; conditionals, not min/max, and the formula in this
        # body, typed as floats, not a call: this runs per instance per decision (a call more
        # was +3% of a live decision, and a float | ndarray formula boxed each float under mypyc).
        p = num_prefix_tokens if num_prefix_tokens < num_tokens else num_tokens - 1
        if p < 0:
            p = 0
        n = num_tokens - p
        t = self.c0 + self.c1 * n + self.c2 * n * (p + n) + self.c3 * p
        return t if t > 0.0 else 0.0

    def chunk_after(self, num_tokens: int, num_prefix_tokens: int) -> float:
        """Seconds of a chunk after a prompt's first, computing tokens ``num_prefix_tokens`` to
        ``num_tokens`` over the keys before them: ``later_c0`` (or ``c0``) fixed, nothing loaded."""
        n = num_tokens - num_prefix_tokens
        later = self.c0 if self.later_c0 is None else self.later_c0
        t = later + self.c1 * n + self.c2 * n * num_tokens
        return t if t > 0.0 else 0.0

    def with_chunk(self, chunk: int) -> PrefillCostModel:
        """This model for an instance that computes at most ``chunk`` tokens a forward (0: one
        pass, however long the prompt: an instance that did not say its chunk)."""
        if chunk < 0:    # the wire's bound is checked where the message is decoded (protocol.Register)
            raise ValueError(f"a prefill chunk must not be negative, got {chunk}")
        if not chunk:
            return self if type(self) is PrefillCostModel else \
                PrefillCostModel(self.c0, self.c1, self.c2, self.c3, self.later_c0, self.member_c0)
        if isinstance(self, ChunkedPrefillCostModel) and self.chunk == chunk:
            return self
        return ChunkedPrefillCostModel(self.c0, self.c1, self.c2, self.c3, self.later_c0, self.member_c0, chunk)

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> PrefillCostModel:
        """Least-squares fit from ``(num_tokens, num_prefix_tokens, seconds)`` samples."""
        rows, ys = [], []
        for num_tokens, prefix, seconds in samples:
            n = num_tokens - prefix
            rows.append([1.0, n, n * (prefix + n), prefix])
            ys.append(seconds)
        c0, c1, c2, c3 = _lstsq(rows, ys, 4, "PrefillCostModel.fit")
        return PrefillCostModel(c0, c1, c2, c3)


@dataclass(frozen=True, slots=True)
class ChunkedPrefillCostModel(PrefillCostModel):
    """The prefill formula on an instance that computes at most ``chunk`` tokens a forward (its
    ``--prefill-chunk``, from its registration): a prompt with more uncached tokens runs chunk by
    chunk, each one forward over the keys before it, and is priced as the sum of its chunks
    (:meth:`_chunked`). A subclass, so an instance that said no chunk pays no comparison in the
    hot :meth:`PrefillCostModel.predict`. ``chunk`` is local: it never travels in ``to_dict``."""

    chunk: int = UNCHUNKED

    def predict(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        """:meth:`PrefillCostModel.predict`'s formula, inline for speed as there, or the chunks' sum."""
        p = num_prefix_tokens if num_prefix_tokens < num_tokens else num_tokens - 1
        if p < 0:
            p = 0
        n = num_tokens - p
        if n > self.chunk:
            return self._chunked(n, p)
        t = self.c0 + self.c1 * n + self.c2 * n * (p + n) + self.c3 * p
        return t if t > 0.0 else 0.0

    def _chunked(self, n: int, p: int) -> float:
        """``n`` > ``chunk`` uncached tokens after ``p`` cached ones, run as k full chunks of C and a
        remainder r (``n = k·C + r``, m = k + (r > 0) forwards), chunk i a forward of n_i new tokens
        over p_i = p + (the earlier chunks' tokens): Σ_i [c0 + c1·n_i + c2·n_i·(p_i + n_i) + c3·p_i]
        (``later_c0`` for c0 after the first, where set; c3·p once: the first chunk loads the
        cached prefix, the later ones' keys are their own prompt's) in O(1). Σ n_i·(p_i + n_i) =
        n·p + (n² + Σ n_i²)/2 (each pair of tokens once, a token with itself and its own chunk's
        later ones too), Σ n_i² = k·C² + r². Exact in integers: n² + k·C² + r² is even."""
        c = self.chunk
        k, r = divmod(n, c)
        m = k + 1 if r else k
        pairs = n * p + (n * n + k * c * c + r * r) // 2
        later = self.c0 if self.later_c0 is None else self.later_c0
        t = self.c0 + later * (m - 1) + self.c1 * n + self.c2 * pairs + self.c3 * p
        return t if t > 0.0 else 0.0


def pack_sizes(uncached_tokens: Sequence[int], limit: int, caps: Sequence[int] | None = None) -> list[int]:
    """Prefill batching's rule: how a queue of prompts with these uncached token counts is cut
    into packed forwards, in its order. From the head, prompts join the pack while their uncached
    tokens together fit in the pack's bound; the first that does not starts the next pack; a
    prompt over ``limit`` is a pack of its own (it runs alone, chunked). ``limit`` <= 0: one
    prompt a pack. The bound is ``limit``, lowered by each member's cap (``caps``, one a prompt,
    0: none): the most tokens a forward it is in may hold, so that the forward still ends within
    its TTFT SLO (``scheduler.packing.slo_pack_cap``). A prompt joins only a pack it fits in
    under its own cap too: a short prompt is never held past its SLO by the long ones behind it."""
    return list(iter_pack_sizes(uncached_tokens, limit, caps))


def iter_pack_sizes(uncached_tokens: Iterable[int], limit: int, caps: Iterable[int] | None = None) -> Iterator[int]:
    """:func:`pack_sizes` one pack at a time: a pack's size comes out once the prompt after it
    has been read (or the queue ended), so taking the first reads no further than it needs."""
    if caps is not None:
        yield from _capped_pack_sizes(uncached_tokens, limit, caps)
        return
    size = total = 0
    for n in uncached_tokens:
        if size and limit > 0 and total + n <= limit:
            size += 1
            total += n
        else:
            if size:
                yield size
            size, total = 1, (n if n <= limit else limit + 1)   # an oversize prompt takes nobody along
    if size:
        yield size


def capped(bound: int, cap: int) -> int:
    """A pack's bound once a member with ``cap`` is in it (0: no cap; :func:`pack_sizes`)."""
    return cap if 0 < cap < bound else bound


def _capped_pack_sizes(uncached_tokens: Iterable[int], limit: int, caps: Iterable[int]) -> Iterator[int]:
    """:func:`iter_pack_sizes` with each prompt's cap lowering its pack's bound."""
    size = total = bound = 0
    for n, cap in zip(uncached_tokens, caps):
        if size and limit > 0 and total + n <= capped(bound, cap):
            size += 1
            total += n
            bound = capped(bound, cap)
        else:
            if size:
                yield size
            size, total, bound = 1, (n if n <= limit else limit + 1), capped(limit, cap)
    if size:
        yield size


def packed_durations(model: PrefillCostModel, jobs: Sequence[tuple[int, int]], limit: int,
                     caps: Sequence[int] | None = None) -> list[float]:
    """Each job's predicted duration in a queue of ``(num_tokens, num_prefix_tokens)`` jobs run
    packed by :func:`pack_sizes` (the prefill instance's ``--prefill-batch-tokens``, capped at its
    chunk). One forward pays the shared part of the fixed ``c0`` once and each job the rest and
    its own token terms, so a pack takes ``shared_c0 + Σ (predict(job) - shared_c0)``. The last job of a pack carries the pack's time and the
    others 0, so the total and each pack's end (the running sum at its last job) are right, and a
    started pack counts as done for its elapsed time, exactly as with one job at a time (which
    ``limit`` 0 gives: each job's own ``predict``). The conductor's estimate needs every job's
    finish time and the running forward as started: :func:`scheduler.packing.packed_queue`."""
    predict, c0 = model.predict, model.shared_c0
    own = [predict(n, p) for n, p in jobs]
    out: list[float] = []
    i = 0
    for size in pack_sizes([uncached_tokens(n, p) for n, p in jobs], limit, caps):
        out.extend([0.0] * (size - 1))
        out.append(packed_seconds(own[i:i + size], c0))
        i += size
    return out


def packed_seconds(alone_s: Sequence[float], c0: float) -> float:
    """One packed forward of jobs that take ``alone_s`` each alone: the fixed ``c0`` they share
    (a model's ``shared_c0``) paid once."""
    return max(0.0, sum(alone_s) - c0 * (len(alone_s) - 1)) if alone_s else 0.0


def uncached_tokens(num_tokens: int, num_prefix_tokens: int) -> int:
    """Tokens a prefill computes: the prompt less its cached prefix, never less than the last token."""
    return num_tokens - min(max(num_prefix_tokens, 0), num_tokens - 1)


@dataclass(frozen=True, slots=True)
class DecodeCostModel(_Coefficients):
    """Seconds per decode step (TBT) for a batch: ``t = c0 + c1·batch_size + c2·context_tokens``
    (weights read once per step, per-sequence overhead, attention over all cached tokens)."""

    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0

    def predict(self, batch_size: int, context_tokens: int) -> float:
        """Predicted TBT of one step; an empty batch costs nothing."""
        if batch_size <= 0:
            return 0.0
        t = self.c0 + self.c1 * batch_size + self.c2 * context_tokens
        return t if t > 0.0 else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> DecodeCostModel:
        """Least-squares fit from ``(batch_size, context_tokens, step_seconds)`` samples."""
        rows, ys = [], []
        for batch_size, context_tokens, seconds in samples:
            rows.append([1.0, batch_size, context_tokens])
            ys.append(seconds)
        return cls(*_lstsq(rows, ys, 3, "DecodeCostModel.fit"))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × dtype bytes — 327,680 for LLaMA2-70B fp16."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@overload
def transfer_seconds(num_bytes: int, bandwidth_bytes_per_s: float, latency_s: float) -> float: ...


@overload     # numpy rows (scheduler/wide.py)
def transfer_seconds(num_bytes: int | np.ndarray, bandwidth_bytes_per_s: float | np.ndarray,
                     latency_s: float) -> float | np.ndarray: ...


def transfer_seconds(num_bytes: int | np.ndarray, bandwidth_bytes_per_s: float | np.ndarray,
                     latency_s: float) -> float | np.ndarray:
    """The KV transfer formula, once: a fixed latency plus the bytes at the link's bandwidth, for
    one fetch or numpy rows of them (scheduler/wide.py) — the same IEEE-754 operations in the
    same order either way. Callers pass a positive byte count (a fetch of nothing is no fetch)."""
    return latency_s + num_bytes / bandwidth_bytes_per_s


def kv_transfer_time(num_bytes: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> float:
    """:func:`transfer_seconds` checked: seconds to move ``num_bytes`` at a measured bandwidth
    (0 bytes cost nothing; a bandwidth that is not positive is an error)."""
    if num_bytes <= 0:
        return 0.0
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    return transfer_seconds(num_bytes, bandwidth_bytes_per_s, latency_s)


@dataclass(frozen=True)
class CostModels:
    """Cluster-wide defaults; an instance's own reported model (``state.cost``) wins over these."""

    prefill: PrefillCostModel
    decode: DecodeCostModel
    kv_bytes_per_token: int
    bandwidth_bytes_per_s: float = 10e9
    transfer_latency_s: float = 0.0
    # Measured speed per store pair (the live conductor's, updated in place as prefills report
    # transfers); a measured pair wins over an instance's and the default bandwidth. None: the
    # fixed figures only (the simulator).
    links: LinkSpeeds | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be positive, got {self.kv_bytes_per_token}")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s}")


def scaled(model, factor: float, offset: float = 0.0):
    """A cost model (prefill or decode) with ``offset`` seconds added to its fixed cost ``c0`` (a
    prefill state's line, ``forward_fit.py``) and every coefficient multiplied by ``factor``: each
    job's prediction is ``factor × (x + offset)`` (the formulas, a prefill's chunked sum too, are
    linear in the coefficients), its chunk kept; paid once a job, as fitted: a chunked model's later
    chunks keep their ``c0`` (``later_c0``). The same object when ``factor`` is 1 and ``offset`` 0."""
    if (factor == 1.0 and offset == 0.0) or model is None:
        return model
    coefs = model.to_dict()
    if offset and hasattr(model, "later_c0"):   # a prefill's
        coefs.setdefault("later_c0", coefs["c0"])
    coefs["c0"] += offset
    return replace(model, **{k: v * factor for k, v in coefs.items()})
