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
