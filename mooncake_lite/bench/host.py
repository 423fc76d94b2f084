"""Which CPU a benchmark ran on, in one line for its report.

Figures from different machines do not compare: the same simulator code took 183 s on one
2-vCPU EPYC and 65 s on another (docs/sim.md, "Scale"), and whether oneDNN or MKL runs a
product faster flips between them (docs/model.md). Every report that prints seconds or rates
says which CPU made them, so a reader compares runs on one machine only.
"""

from __future__ import annotations

import platform

from mooncake_lite.cluster.machine import usable_cpus


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """e.g. ``AMD EPYC (family 26, model 2), AVX-512, 2 CPUs``: the first processor's model name,
    family and model, the widest vector extension it lists, and the CPUs this process sees."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break                      # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    ident = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    parts = [name + (f" ({', '.join(ident).replace('cpu family', 'family')})" if ident else "")]
    if vector:
        parts.append(vector + (" with BF16" if "avx512_bf16" in flags or "amx_bf16" in flags else ""))
    parts.append(f"{len(usable_cpus())} CPUs")
    return ", ".join(parts)

