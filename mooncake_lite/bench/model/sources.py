"""What each model spec names (a preset, a packaged checkpoint, a GGUF file, an HF directory) and
which of a list can be measured here (``bench model`` and ``bench pd``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from mooncake_lite.model.source import NAMED_MODELS, resolve
from mooncake_lite.model.weights import model_args


def describe_model(spec: str) -> dict:
    """What ``spec`` names: a preset with seeded dummy weights, or a real checkpoint (and where)."""
    source = resolve(spec)
    if source.kind == "preset":
        return {"kind": "preset", "weights": "dummy (seeded random)", "path": None,
                "description": f"preset {spec!r} with seeded dummy weights"}
    description = (NAMED_MODELS[spec].description if spec in NAMED_MODELS
                   else f"{'GGUF file' if source.kind == 'gguf' else 'HF checkpoint'} {source.served_name}")
    return {"kind": source.kind, "weights": "checkpoint", "path": source.path, "description": description}


def usable_models(models: Sequence[str], *, drop_missing: bool) -> tuple[dict[str, float], list[str]]:
    """({model: seconds its shape took to read}, notes). A bad spec raises now, not after a
    minute of measuring; with ``drop_missing`` (the default list) a named model whose package is
    absent is skipped with a note; none left is a ValueError. The time is the first read of a checkpoint's header/config
    (a GGUF's metadata, vocabulary included), part of what loading it costs."""
    keep, notes = {}, []
    for name in models:
        t0 = time.perf_counter()
        try:
            model_args(name)
        except FileNotFoundError as exc:
            if not (drop_missing and name in NAMED_MODELS):
                raise
            notes.append(f"skipped {name}: {exc}")
            continue
        keep[name] = time.perf_counter() - t0
    if not keep:
        raise ValueError("no model to measure: " + "; ".join(notes))
    return keep, notes


def model_list(text: str | None, defaults: Sequence[str]) -> tuple[list[str], bool]:
    """``--models``: the comma-separated specs, or the default list (and whether it is that)."""
    return (list(defaults), True) if text is None else ([m for m in text.split(",") if m], False)
