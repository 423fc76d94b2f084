"""The waiting list's record (scheduler/waiting.py): replayed by the queue order's rule, and one
more job landed in it, which is how ``bench fidelity`` judges a refused request on live's order."""

from mooncake_lite.scheduler.waiting import FREE, GRANT, LAND, START, Added, TurnRecord, replay


def record(*events):
    clock = iter(t for t, *_ in events)
    rec = TurnRecord(clock=lambda: next(clock))
    for _, kind, *rest in events:
        rec.note(kind, *rest)
    return list(rec.events)


# A (300 tokens) holds the instance from 0 to 5; B (100) lands at 1, C (50) at 2 and passes B
# (shortest first, bound 4); C runs 5-6, B 6-8.
SHORTEST = record((0.0, LAND, "A", 300), (0.0, GRANT, "A"), (1.0, LAND, "B", 100), (2.0, LAND, "C", 50),
                  (5.0, FREE), (5.0, GRANT, "C"), (6.0, FREE), (6.0, GRANT, "B"), (8.0, FREE))


def test_the_record_replays_to_the_instances_order_and_a_wrong_one_does_not():
    assert replay(SHORTEST, 4) == replay(SHORTEST, 4).__class__(3, 3, None)
    fifo = replay(SHORTEST, 0)      # read FIFO, B heads the list when C was given its turn
    assert (fifo.agreed, fifo.grants) == (2, 3)


def test_a_job_added_to_the_record_gets_the_turn_the_order_gives_it():
    assert replay(SHORTEST, 4, Added(1.5, 20)).turn_s == 5.0   # passes B, C does not pass it
    assert replay(SHORTEST, 4, Added(2.0, 20, index=3)).turn_s == 5.0   # placed before C's landing
    assert replay(SHORTEST, 4, Added(2.0, 70, index=4)).turn_s == 6.0   # after it: behind C, ahead of B
    assert replay(SHORTEST, 4, Added(1.5, 70)).turn_s == 6.0   # passes B, C passes it
    assert replay(SHORTEST, 4, Added(1.5, 500)).turn_s == 8.0  # behind both
    fifo = record((0.0, LAND, "A", 300), (0.0, GRANT, "A"), (1.0, LAND, "B", 100), (2.0, LAND, "C", 50),
                  (5.0, FREE), (5.0, GRANT, "B"), (7.0, FREE), (7.0, GRANT, "C"), (8.0, FREE))
    assert replay(fifo, 0).agreed == 3 and replay(fifo, 0, Added(1.5, 20)).turn_s == 7.0   # behind B
    assert replay(SHORTEST, 4, Added(7.0, 20)).turn_s == 8.0   # B running: when it ends
    assert replay(SHORTEST, 4, Added(9.0, 20)).turn_s == 9.0   # after the record: free at once
    idle = record((0.0, LAND, "A", 300), (0.0, GRANT, "A"), (5.0, FREE), (9.0, LAND, "D", 10))
    assert replay(idle, 4, Added(6.0, 20)).turn_s == 6.0   # the instance free: its turn is at once


def test_a_job_landing_after_a_packs_members_were_chosen_waits_behind_them():
    # A leads a pack and has chosen B; R (10 tokens, shorter than B) lands then: behind B.
    pack = record((0.0, LAND, "A", 30), (0.0, LAND, "B", 40), (0.0, GRANT, "A"), (0.1, START, "B"),
                  (2.0, FREE), (2.0, GRANT, "B"), (2.0, FREE))
    assert replay(pack, 4).agreed == 2
    assert replay(pack, 4, Added(1.0, 10)).turn_s == 2.0
    unrecorded = [e for e in pack if e[1] != START]     # without the start, R would pass B
    assert replay(unrecorded, 4, Added(1.0, 10)).turn_s == 2.0 and replay(unrecorded, 4).agreed == 2


def test_a_job_placed_first_that_reaches_the_instance_later_passes_uncounted():
    """A burst placed shortest first (C #1, then L1-L4 #2-#5, all longer) reaches the instance in
    another order: the long ones first. C passing them is no overtake (the conductor placed C
    first and counted none), so their passes are left for the later arrivals the conductor lets
    pass them: X (#6, longer than C) passes all four. Counted, the four would have used their one
    each (a bound of 1), and X would have waited behind them."""
    from mooncake_lite.scheduler.waiting import Entry, land, placed_after
    waiting = [Entry(f"L{i}", 1000 + i, placed=("c0", 1 + i)) for i in range(1, 5)]   # arrived first
    land(waiting, Entry("C", 10, placed=("c0", 1)), 1, lambda e: e.started)
    assert waiting[0].request_id == "C" and all(e.passed == 0 for e in waiting[1:])
    land(waiting, Entry("X", 15, placed=("c0", 6)), 1, lambda e: e.started)
    assert [e.request_id for e in waiting][:2] == ["C", "X"] and all(e.passed == 1 for e in waiting[2:])
    # another conductor's numbers are not comparable, and a job without one counts as before
    assert not placed_after(Entry("a", 1, placed=("c1", 9)), Entry("b", 1, placed=("c0", 1)))
    assert not placed_after(Entry("a", 1, placed=("c0", 9)), Entry("b", 1))
    late = [Entry("L", 1000, placed=("c1", 2))]
    land(late, Entry("C", 10, placed=("c0", 1)), 1, lambda e: e.started)
    assert late[1].passed == 1


def test_the_record_keeps_where_each_job_was_placed_and_replays_by_it():
    """The record's landings carry their placement (a sixth field), the replay lands by the same
    rule: here C, placed before L but reaching the instance after it, leaves L's one pass to X,
    which the instance served before L. A record of five fields (an older instance) still reads."""
    events = record((0.0, LAND, "A", 300, False, ("c0", 1)), (0.0, GRANT, "A"),
                    (1.0, LAND, "L", 200, False, ("c0", 3)), (1.0, LAND, "C", 50, False, ("c0", 2)),
                    (2.0, LAND, "X", 20, False, ("c0", 4)), (5.0, FREE), (5.0, GRANT, "X"), (6.0, FREE),
                    (6.0, GRANT, "C"), (7.0, FREE), (7.0, GRANT, "L"), (9.0, FREE))
    assert replay(events, 1).agreed == 4
    uncounted = [(*e[:5], None) for e in events]      # without the placements: L out of passes, X behind it
    assert replay(uncounted, 1).agreed < 4
    assert replay([e[:5] for e in SHORTEST], 4).agreed == 3


def test_a_shorter_job_placed_later_that_arrived_first_counts_as_passing_it():
    """The reverse order: L (#1, long) is placed before S1 and S2 (#2, #3, shorter), which pass it
    in the conductor's view; they reach the instance first, and L lands behind them. Its count is
    what the conductor's view has, two, so with a bound of 3 one more later arrival may pass it,
    not three."""
    from mooncake_lite.scheduler.waiting import Entry, land
    waiting = [Entry("S1", 100, placed=("c0", 2)), Entry("S2", 200, placed=("c0", 3))]
    land(waiting, Entry("L", 2000, placed=("c0", 1)), 3, lambda e: e.started)
    assert [e.request_id for e in waiting] == ["S1", "S2", "L"] and waiting[2].passed == 2
    land(waiting, Entry("X", 50, placed=("c0", 4)), 3, lambda e: e.started)
    land(waiting, Entry("Y", 60, placed=("c0", 5)), 3, lambda e: e.started)
    assert waiting[-1].request_id == "Y" and waiting[-2].request_id == "L" and waiting[-2].passed == 3


def test_a_job_placed_earlier_takes_back_the_pass_a_later_placed_one_took_by_arriving_first():
    """Three long jobs wait with one pass left each (a bound of 2). The conductor places C (64
    tokens, #2) then L (300, #3): C passes them, L finds no pass left. L reaches the instance
    first and takes the passes; when C lands, L steps back and lands again behind it, as placed
    (live on Zen 3: C waited 10.9 s where priced 2.2 s, waiting.land). The record replays so."""
    from mooncake_lite.scheduler.waiting import Entry, land
    waiting = [Entry(f"W{i}", 800 + i, passed=1) for i in range(3)]
    land(waiting, Entry("L", 300, placed=("c0", 3)), 2, lambda e: e.started)
    assert waiting[0].request_id == "L" and all(e.passed == 2 for e in waiting[1:])   # as it arrived
    land(waiting, Entry("C", 64, placed=("c0", 2)), 2, lambda e: e.started)
    assert [e.request_id for e in waiting] == ["C", "W0", "W1", "W2", "L"]
    assert [e.passed for e in waiting] == [0, 2, 2, 2, 0]
    events = record(*[(0.0, LAND, f"W{i}", 800 + i, False, None) for i in range(3)],
                    (0.1, LAND, "X", 10, False, None), (0.2, GRANT, "X"),   # (one pass each, as above)
                    (1.0, LAND, "L", 300, False, ("c0", 3)), (1.0, LAND, "C", 64, False, ("c0", 2)), (2.0, FREE),
                    *[e for rid in ("C", "W0", "W1", "W2", "L") for e in ((2.0, GRANT, rid), (3.0, FREE))])
    assert replay(events, 2).agreed == 6
