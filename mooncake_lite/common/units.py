"""Parsing of human-written sizes and durations (``8GiB``, ``500ms``)."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUM_UNIT = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"512MB"``, ``"4096"`` or an int. Raises ValueError."""
    if isinstance(value, int):
        return value
    m = _NUM_UNIT.match(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 4096, 64KiB, 8GiB, 1.5GB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(value: str | float | int) -> float:
    """Seconds from ``"500ms"``, ``"2s"``, ``"1.5"`` or a number. Raises ValueError."""
    if isinstance(value, (int, float)):
        return float(value)
    m = _NUM_UNIT.match(str(value))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ValueError(f"not a duration: {value!r} (examples: 0.5, 500ms, 2s, 1min)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
