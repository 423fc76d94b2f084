"""What an instance reports of its own speed: ``Register.cost`` and ``Heartbeat.cost``.

The coefficients are the scheduler's cost models (``scheduler/costs.py``), fitted by the instance
from its own timings; the conductor turns them into those models (``conductor/cluster/costs.py``). On
the wire a :class:`CostReport` is the nested form, every part optional (null or absent: not
reported)::

    {"prefill": {"c0": .., "c1": .., "c2": .., "c3": .., "later_c0": .., "member_c0": ..},  # seconds
     "decode":  {"c0": .., "c1": .., "c2": ..},             # DecodeCost, seconds per step
     "bandwidth_bytes_per_s": 2.5e9}                        # measured inbound KV fetch rate

Instances sent, before this record, their own role's coefficients flat (``{"c0": .., ...}``); a
conductor still accepts that form, decoded as a :class:`FlatCost` and read with the role the
instance registered (:meth:`FlatCost.for_role`). Both are checked when the message is decoded:
an unknown key or coefficient, a coefficient that is not a finite number >= 0, a bandwidth that
is not a finite positive number, or a part that is not an object is refused, naming the field.
So is an absurd one (issue #36): a coefficient over ``MAX_COEFFICIENT_S`` (an hour per call, per
token or per token pair is no measurement of any machine: a unit or a sign bit gone wrong) or a
bandwidth outside ``[MIN_BANDWIDTH, MAX_BANDWIDTH]``. A refused report never reaches a model: the
whole message is refused (400), and the refusal is logged once per distinct reason (a heartbeat
repeats it every beat).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

REPORT_KEYS = ("prefill", "decode", "bandwidth_bytes_per_s")
MAX_COEFFICIENT_S = 3600.0        # seconds per call / token / token pair: beyond, absurd
MIN_BANDWIDTH, MAX_BANDWIDTH = 1.0, 1e15   # bytes/s: beyond either, absurd
OPTIONAL = frozenset({"later_c0", "member_c0"})   # coefficients an instance may not have measured: null is "none"
log = logging.getLogger(__name__)
_LOGGED: set[str] = set()         # refusals already logged (bounded: _MAX_LOGGED)
_MAX_LOGGED = 1024


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to prefill n new tokens on p cached ones: c0 + c1·n + c2·n·(p + n) + c3·p
    (``PrefillCostModel``); ``later_c0`` for c0 in a chunk after a prompt's first (None: c0);
    ``member_c0`` what of c0 each job of a packed forward beyond the first pays (None: none)."""
    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0
    c3: float = 0.0
    later_c0: float | None = None
    member_c0: float | None = None


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of one decode step: c0 + c1·batch size + c2·context tokens (``DecodeCostModel``)."""
    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0


@dataclass(frozen=True)
class CostReport:
    """An instance's cost models as it measured them; None: not reported (the cluster default,
    or on a heartbeat what it reported before)."""
    prefill: PrefillCost | None = None
    decode: DecodeCost | None = None
    bandwidth_bytes_per_s: float | None = None   # measured inbound KV fetch rate

    @classmethod
    def from_wire(cls, data: Any, where: str) -> CostReport | FlatCost:
        """The report of decoded JSON ``data`` (either form); ValueError names what is wrong,
        from ``where`` (the field it came in, e.g. ``Register.cost``), and is logged."""
        try:
            return cls._decode(data, where)
        except ValueError as exc:
            _log_refusal(str(exc))
            raise

    @classmethod
    def _decode(cls, data: Any, where: str) -> CostReport | FlatCost:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object")
        if data and all(k.startswith("c") and k[1:].isdigit() for k in data):
            return FlatCost(**_coefficients(FlatCost, data, where))
        unknown = sorted(set(data) - set(REPORT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {list(REPORT_KEYS)}, "
                             "or the flat form c0..c3")
        bandwidth = data.get("bandwidth_bytes_per_s")
        if bandwidth is not None and not (_is_number(bandwidth) and 0 < bandwidth < math.inf):
            raise ValueError(f"{where}.bandwidth_bytes_per_s: must be a finite positive number, got {bandwidth!r}")
        if bandwidth is not None and not MIN_BANDWIDTH <= bandwidth <= MAX_BANDWIDTH:
            raise ValueError(f"{where}.bandwidth_bytes_per_s: {bandwidth!r} bytes/s is absurd (outside "
                             f"[{MIN_BANDWIDTH:g}, {MAX_BANDWIDTH:g}])")
        return cls(_part(PrefillCost, data.get("prefill"), f"{where}.prefill"),
                   _part(DecodeCost, data.get("decode"), f"{where}.decode"),
                   None if bandwidth is None else float(bandwidth))


@dataclass(frozen=True)
class FlatCost:
    """The flat form of a report, which instances sent before :class:`CostReport`: the sender's
    own role's coefficients (None: not given, 0). Only decoded, never sent."""
    c0: float | None = None
    c1: float | None = None
    c2: float | None = None
    c3: float | None = None   # a prefill's only

    def for_role(self, role: str) -> CostReport:
        """The report as ``role``'s models; ValueError when it does not fit that role."""
        given = {k: v for k, v in self.__dict__.items() if v is not None}
        if role == "prefill":
            return CostReport(prefill=PrefillCost(**given))
        if role != "decode":
            raise ValueError(f"cost: a flat cost model needs the role prefill or decode, not {role!r}")
        if "c3" in given:
            raise ValueError(f"cost: unknown coefficient(s) ['c3'] of a decode instance; "
                             f"expected {_names(DecodeCost)}")
        return CostReport(decode=DecodeCost(**given))


def _part(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object of coefficients")
    return cls(**_coefficients(cls, data, where))


def _coefficients(cls: type, data: dict[str, Any], where: str) -> dict[str, float]:
    names = _names(cls)
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown coefficient(s) {unknown}; expected {names}")
    given = {name: v for name, v in data.items() if v is not None or name not in OPTIONAL}
    for name, v in given.items():
        if not (_is_number(v) and 0 <= v < math.inf):
            raise ValueError(f"{where}.{name}: must be a finite number >= 0, got {v!r}")
        if v > MAX_COEFFICIENT_S:
            raise ValueError(f"{where}.{name}: {v!r} s is absurd (over {MAX_COEFFICIENT_S:g} s)")
    return {name: float(v) for name, v in given.items()}


def _log_refusal(message: str) -> None:
    if message in _LOGGED:
        return
    if len(_LOGGED) < _MAX_LOGGED:
        _LOGGED.add(message)
    log.warning("cost report refused, the instance's model is unchanged: %s", message)


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
