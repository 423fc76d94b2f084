"""The one line naming the CPU a benchmark ran on (``bench/host.py``)."""

from mooncake_lite.bench.host import cpu_description
from mooncake_lite.cluster.machine import usable_cpus

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 fma

processor\t: 1
model name\t: something else
"""


def test_a_cpu_is_named_by_its_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN5)
    assert cpu_description(str(info)) == f"AMD EPYC (family 26, model 2), AVX-512 with BF16, {len(usable_cpus())} CPUs"
    info.write_text("model name\t: Old Xeon\nflags\t\t: sse2 avx2\n")
    assert cpu_description(str(info)) == f"Old Xeon, AVX2, {len(usable_cpus())} CPUs"


def test_no_cpuinfo_still_names_something(tmp_path):
    text = cpu_description(str(tmp_path / "missing"))
    assert text.endswith(f"{len(usable_cpus())} CPUs") and len(text) > len(" CPUs") + 3
