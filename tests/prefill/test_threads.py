"""Borrowed threads (prefill/threads.py): the prefill takes an extra torch thread only while the
rest of the machine leaves a CPU idle, and gives it back once it does not."""

import pytest

from mooncake_lite.prefill.threads import (WINDOW_S, BorrowingExecutor, ThreadBorrower, extra_threads,
                                           machine_busy_seconds)


@pytest.mark.parametrize("others, want", [(0.0, 1), (0.2, 1), (0.5, 0), (1.0, 0), (1.6, 0)])
def test_extra_threads_on_two_cpus(others, want):
    assert extra_threads(num_cpus=2, own=1, borrow=1, others_busy=others) == want


def test_extra_threads_never_exceed_the_loan():
    assert extra_threads(num_cpus=16, own=4, borrow=4, others_busy=0.0) == 4
    assert extra_threads(num_cpus=16, own=4, borrow=4, others_busy=9.9) == 2


class Machine:
    """A 2-CPU box: the prefill's own CPU use and everyone else's, advanced by hand."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.applied = []

    def run(self, seconds, own_cpus, other_cpus):
        self.now += seconds
        self.own += seconds * own_cpus
        self.busy += seconds * (own_cpus + other_cpus)

    def borrower(self):
        return ThreadBorrower(1, 1, num_cpus=2, busy=lambda: self.busy, own_cpu=lambda: self.own,
                              clock=lambda: self.now, apply=self.applied.append)


def test_borrows_while_the_decode_is_idle_and_gives_back_when_it_steps():
    m = Machine()
    b = m.borrower()
    m.run(0.05, 1, 0)
    assert b.pick() == 1 and not m.applied              # less than a window seen: no decision yet
    m.run(1.5 * WINDOW_S, 1, 0.05)                             # the decode idle (the conductor barely busy)
    assert b.pick() == 2 and m.applied == [2]
    m.run(1.5 * WINDOW_S, 1.1, 0.9)                            # decode steps: the prefill gets less than 2 CPUs
    assert b.pick() == 1 and m.applied == [2, 1]
    m.run(1.5 * WINDOW_S, 1, 0.0)
    assert b.pick() == 2 and b.num_borrowed == 2


def test_no_proc_stat_means_no_borrowing(tmp_path):
    assert machine_busy_seconds(str(tmp_path / "missing")) is None
    b = ThreadBorrower(1, 1, num_cpus=2, busy=lambda: None, apply=lambda n: pytest.fail("set threads"))
    assert b.pick() == 1
    assert machine_busy_seconds() is None or machine_busy_seconds() > 0


def test_the_executor_picks_before_each_call():
    m = Machine()
    m.run(1.0, 1, 0)
    b = m.borrower()
    with BorrowingExecutor(b) as ex:
        m.run(1.5 * WINDOW_S, 1, 0)
        assert ex.submit(lambda x: x + 1, 41).result() == 42
    assert m.applied == [2] and b.threads == 2


def test_a_held_count_is_kept_whatever_the_machine_does():
    m = Machine()
    b = m.borrower()
    with b.held(1):
        m.run(1.5 * WINDOW_S, 1, 0.0)                          # idle: it would borrow
        assert b.pick() == 1 and b.num_borrowed == 0
    with b.held(2):
        m.run(1.5 * WINDOW_S, 1.1, 0.9)                        # decode steps: it would give back
        assert b.pick() == 2 and m.applied == [2]
    m.run(1.5 * WINDOW_S, 1.1, 0.9)
    assert b.pick() == 1 and m.applied == [2, 1]               # released: the machine decides again
