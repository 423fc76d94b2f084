"""A decode view's step group (``enter_group`` / ``progress_group``, what the simulator's
engine batches use) against ``progress_each`` over the same members: the same states, and the
same answers, through random histories of joins, steps, single progress, leaves and clears."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.scheduler import DecodeCostModel, DecodeView

MODEL = DecodeCostModel(c0=0.04, c1=1e-4, c2=3e-8)


@pytest.mark.parametrize("seed", range(8))
def test_a_step_group_shows_what_progress_each_of_its_members_shows(seed):
    rng = random.Random(seed)
    each, group = DecodeView("d", MODEL), DecodeView("d", MODEL)
    joined: list[str] = []          # in the view (KV arrived)
    members: list[str] = []         # and stepping with the batch
    for step in range(600):
        op = rng.choice(["join", "join", "enter", "enter", "step", "step", "step", "progress", "leave",
                         "state", "state", "rejoin", "commit"] + (["clear"] if step % 97 == 96 else []))
        if op == "join":
            rid, ctx, max_out = f"r{step}", rng.randint(1, 20000), rng.choice([None, 300])
            for v in (each, group):
                v.join(rid, ctx, float(step), max_out)
            joined.append(rid)
        elif op == "rejoin" and joined:    # the same id joins again (replaced where it stands)
            rid = rng.choice(joined)
            ctx = rng.randint(1, 20000)
            for v in (each, group):
                v.join(rid, ctx, float(step), 100)
            if rid in members:
                members.remove(rid)
        elif op == "commit":
            for v in (each, group):
                v.commit(f"c{step}", 50, 10)
        elif op == "enter":
            waiting = [r for r in joined if r not in members]
            if waiting:
                rid = rng.choice(waiting)
                members.append(rid)
                group.enter_group(rid)
        elif op == "step":
            n = rng.randint(1, 60)
            assert each.progress_each(members, n) == group.progress_group(n)
        elif op == "progress" and joined:
            rid, n = rng.choice(joined), rng.randint(1, 40)
            assert each.progress(rid, n) == group.progress(rid, n)
        elif op == "leave" and joined:
            rid = rng.choice(joined)
            joined.remove(rid)
            if rid in members:
                members.remove(rid)
            assert each.leave(rid) == group.leave(rid)
        elif op == "clear":
            each.clear()
            group.clear()
            joined, members = [], []
        if op == "state" or rng.random() < 0.3:
            assert each.state() == group.state()
    assert each.state() == group.state()
