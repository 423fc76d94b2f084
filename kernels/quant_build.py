"""Building and loading ``quant_matmul.c``, the CPU kernel for GGUF-quantized weights.

The source is compiled here, on the machine that runs it, with the system C compiler for this
CPU (``-march=native``: AVX-512 where the CPU has it), once per source, CPU and compiler, into
``$MOONCAKE_KERNEL_CACHE`` (default ``~/.cache/mooncake-lite/kernels``), and loaded with ctypes:
~1 s the first time, nothing after. Without a compiler nothing is built and :func:`library`
answers None, so callers fall back to the torch reference (a model then dequantizes at load).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_matmul.c")
# -ffp-contract=fast: the products accumulate with fused multiply-adds; the dequantization keeps
# gguf's own roundings through an explicit barrier in the source. OpenMP splits output rows.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cache_dir() -> str:
    return os.environ.get("MOONCAKE_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "mooncake-lite", "kernels")


def _compile(compiler: str, target: str) -> None:
    """Builds into a temporary file first: processes starting together may race to build it."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, SOURCE, "-o", tmp], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no C compiler, or it failed: the reason is logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: GGUF-quantized weights are dequantized at load instead")
        return None
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(FLAGS).encode() + compiler.encode()
                             + platform.machine().encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"quant_matmul-{key}.so")
    try:
        if not os.path.exists(target):
            _compile(compiler, target)
        lib = ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("the quantized-matmul kernel did not build (%s): quantized weights are dequantized "
                    "at load instead", str(detail).strip()[:500])
        return None
    fn = lib.quant_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn = lib.quant_dequantize
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib
