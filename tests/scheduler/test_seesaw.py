"""The seesaw of docs/paper.md §3: with early rejection the decode load read *now* lags the
prefill pipeline, so prefill and decode load swing in anti-phase; prediction-based admission
reads the decode load at the moment the request would reach it and keeps decode steady.

Early counts the requests already committed to decode (``incoming``) as if they were there now,
so it never overfills decode (no wasted prefill) — but it does not see that the running batch
will have drained by the time they arrive: after a full batch it admits nothing, then admits a
whole batch at once when the old one leaves, and decode sits empty through that batch's
prefill. The seesaw survives; its cost is throughput rather than wasted prefills."""

import numpy as np
import pytest

from tests.scheduler.seesaw import NUM_PREFILL, run_scenario

CAPACITY = 8      # decode batch at which TBT reaches the SLO in the scenario
WARMUP = 240      # steps (60 s) before the statistics start


def oscillation(trace):
    """(coefficient of variation of the decode batch, share of time decode is at most half
    full) over the steady state: both are ~0 for a steadily loaded decode instance."""
    batch = np.asarray(trace.decode_batch[WARMUP:], dtype=float)
    return batch.std() / batch.mean(), float((batch <= CAPACITY / 2).mean())


@pytest.mark.parametrize("decode_spread_s", [0.0, 2.0])
def test_early_rejection_seesaws_and_prediction_does_not(decode_spread_s):
    early = run_scenario("early", decode_spread_s=decode_spread_s)
    pred = run_scenario("predictive", decode_spread_s=decode_spread_s)
    assert early.rejected > 0 and pred.rejected > 0          # it is an overload
    early_cv, early_low = oscillation(early)
    pred_cv, pred_low = oscillation(pred)
    # early: decode repeatedly drains while prefill refills (and overflows when they arrive)
    assert early_cv > 0.3 and early_low > 0.15
    assert pred_cv < early_cv / 3 and pred_low < 0.02
    # the anti-phase: under early rejection decode starves while prefill is saturated, and at
    # other times decode is full while prefill has gone (nearly) idle
    batch = np.asarray(early.decode_batch[WARMUP:])
    busy = np.asarray(early.prefill_busy[WARMUP:])
    assert busy[batch <= CAPACITY / 2].mean() >= 0.6 * NUM_PREFILL > 2 * busy.mean()
    assert ((busy <= NUM_PREFILL / 4) & (batch == CAPACITY)).mean() > 0.02
    assert np.corrcoef(batch, busy)[0, 1] < -0.9
    # consequences: early counts committed requests, so running + incoming never exceeds the
    # batch the SLO allows and nothing is refused at decode; instead decode idles and serves
    # fewer requests
    assert early.wasted_prefills == 0
    assert pred.completed > 1.2 * early.completed
    # the direction of the paper's Table 3: fewer requests refused in all (at the conductor or,
    # after a wasted prefill, at decode)
    assert pred.rejected + pred.wasted_prefills < early.rejected + early.wasted_prefills


def test_without_admission_control_decode_refuses_many_finished_prefills():
    none = run_scenario("none")
    assert none.rejected == 0
    assert none.wasted_prefills > run_scenario("predictive").wasted_prefills
