"""The host facts read from the kernel: the hypervisor's steal, a process's threads' CPU and run-queue
seconds (common/host.py)."""

import os

from mooncake_lite.common.host import steal_seconds, thread_seconds


def test_steal_is_the_cpu_lines_eighth_field_in_seconds(tmp_path):
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  179922 0 22385 216266 1162 0 727 {3 * tick} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert steal_seconds(str(stat)) == 3.0


def test_a_kernel_that_says_nothing_of_steal_gives_none(tmp_path):
    old = tmp_path / "old"
    old.write_text("cpu  1 2 3 4 5 6 7\n")            # before steal was counted
    garbled = tmp_path / "garbled"
    garbled.write_text("intr 1 2 3 4 5 6 7 8 9\n")
    assert steal_seconds(str(old)) is None
    assert steal_seconds(str(garbled)) is None
    assert steal_seconds(str(tmp_path / "missing")) is None


def test_this_machine_counts_steal_or_says_it_does_not():
    stolen = steal_seconds()
    assert stolen is None or stolen >= 0.0


def test_thread_seconds_sum_each_threads_schedstat(tmp_path):
    """Nanoseconds on a CPU and waiting on the run queue, summed over the threads in seconds; a
    thread gone or garbled between the listing and the read is skipped, not a failure."""
    for tid, text in (("1", "1500000000 250000000 40\n"), ("7", "500000000 750000000 9\n"), ("9", "garbled\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(text)
    (tmp_path / "12").mkdir()                                 # ended: no schedstat left
    assert thread_seconds(str(tmp_path)) == (2.0, 1.0)
    assert thread_seconds(str(tmp_path / "missing")) is None


def test_this_process_has_run_or_says_it_cannot_tell():
    before = thread_seconds()
    sum(i * i for i in range(200_000))
    after = thread_seconds()
    assert before is None or (after[0] > before[0] and after[1] >= 0.0)
