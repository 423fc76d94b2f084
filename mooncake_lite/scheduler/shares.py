"""The share of its worst-case allowance a job met (``correction.py``: the overtake and join
shares a prefill serving shortest first, or packing, is priced with). Kept out of the simulator's
compiled modules: it must refuse what a broken report sends, whatever the annotations say."""

from __future__ import annotations

import math


def overtakes_used(wait_s: float, allowance_s: float, measured_queue_s: float | None,
                   speed: float | None) -> float | None:
    """The share of its overtake allowance one job met (module doc), in [0, 1]: its measured
    queue in the model's seconds (over ``speed``, how much slower than predicted its own forward
    ran; 1 when unknown), less ``wait_s`` (the queue predicted before any overtake), over
    ``allowance_s`` (the worst case, ``bound`` × its own prefill; both on the model it was priced
    with). None when it had no allowance or a figure is not a finite number >= 0."""
    figures = (wait_s, allowance_s, measured_queue_s)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
           for v in figures) or allowance_s <= 0:
        return None
    usable = isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0
    queue = measured_queue_s / speed if usable else measured_queue_s
    return min(1.0, max(0.0, (queue - wait_s) / allowance_s))
