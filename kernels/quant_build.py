"""Building and loading ``quant_matmul.c``, the CPU kernel for GGUF-quantized weights.

The sources (``quant_matmul.c``, the float path; ``quant_matmul_i8.c``, integer activations on
VNNI; ``decode_attention.c``, CPU decode attention read in place; ``rms_norm.c``; ``rope_kv.c``,
a decode step's rotary embedding and KV write; ``decode_layers.c``, a decode step's layers in
one call) are compiled here, on the machine that runs them,
with the system C compiler for this CPU
(``-march=native``: AVX-512 and VNNI where the CPU has them, AVX2 elsewhere; each source picks its
code by the compiler's ISA macros, so what runs follows from that one CPU check), once per
source, CPU, target and compiler, into
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
import pathlib
import platform
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(HERE, name) for name in ("quant_matmul.c", "quant_matmul_i8.c", "decode_attention.c",
                                                        "rms_norm.c", "rope_kv.c", "decode_layers.c"))
# -ffp-contract=fast: the products accumulate with fused multiply-adds; the dequantization keeps
# gguf's own roundings through an explicit barrier in the source. OpenMP splits output rows.
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
# The target CPU: native, or another (x86-64-v3: AVX2 without AVX-512 or VNNI) to build and test
# the fallback paths on a machine that has more.
MARCH_ENV = "MOONCAKE_KERNEL_MARCH"


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cache_dir() -> str:
    return os.environ.get("MOONCAKE_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "mooncake-lite", "kernels")


def _compile(compiler: str, march: str, target: str) -> None:
    """Builds into a temporary file first: processes starting together may race to build it."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, f"-march={march}", *SOURCES, "-o", tmp], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The compiled kernel for this CPU (or ``$MOONCAKE_KERNEL_MARCH``), or None (no C compiler,
    or it failed: the reason is logged once)."""
    return build(os.environ.get(MARCH_ENV) or "native")


@functools.cache
def build(march: str) -> ctypes.CDLL | None:
    """The kernels compiled for ``-march=march`` (cached on disk), or None where that fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: GGUF-quantized weights are dequantized at load instead")
        return None
    text = b"".join(pathlib.Path(source).read_bytes() for source in SOURCES)
    key = hashlib.sha256(text + " ".join((*FLAGS, march)).encode() + compiler.encode()
                         + platform.machine().encode() + cpu_flags().encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"quant_matmul-{key}.so")
    try:
        if not os.path.exists(target):
            _compile(compiler, march, target)
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
    fn = lib.quant_matmul_i8
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    # Whether this build has the integer path (VNNI): asked once with a type no path takes, which
    # answers -1 before reading anything where it exists and -2 where not, so no product calls a
    # kernel that can only say no.
    lib.has_int8 = fn(-1, None, 0, 0, None, 0, 0, None, 1, None, 0.0, None) != -2
    fn = lib.rope_kv_write
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 5, ctypes.c_int64]
    fn = lib.rms_norm
    fn.restype = None
    fn.argtypes = [*[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [*[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 7, ctypes.c_float, ctypes.c_int]
    fn = lib.decode_layers
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   *[ctypes.c_void_p] * 5, ctypes.c_int]
    return lib
