"""Invariants of a decision on random clusters (hypothesis)."""

from dataclasses import replace

from hypothesis import given, settings, strategies as st

from mooncake_lite.scheduler import (BlockIndex, ClusterState, DecodeCostModel, DecodeInstanceState,
                                     DecodingRequest, FromScratch, IncomingRequest, PrefillInstanceState,
                                     PrefillCostModel, QueuedPrefill, ScheduleRequest, kv_transfer_time,
                                     prefill_queue_time, schedule)
from mooncake_lite.scheduler.admission import choose_decode
from mooncake_lite.scheduler.estimate import (decode_has_room, decode_load_at, decode_load_now, decode_tbt,
                                              queues_at)
from mooncake_lite.scheduler.prefill_select import choose_prefill
from tests.scheduler.clusters import BS, COSTS, cfg

NUM_BLOCKS = 12


@st.composite
def scenarios(draw):
    num_p = draw(st.integers(1, 5))
    idx = BlockIndex()
    prefills = []
    for i in range(num_p):
        held = draw(st.integers(0, NUM_BLOCKS))
        idx.add(f"s{i}", range(held))
        jobs = tuple(QueuedPrefill(f"q{i}-{j}", draw(st.integers(1, 400)),
                                   started_at=(-draw(st.floats(0, 1)) if j == 0 else None))
                     for j in range(draw(st.integers(0, 3))))
        prefills.append(PrefillInstanceState(f"p{i}", f"s{i}", jobs,
                                             bandwidth_bytes_per_s=draw(st.sampled_from([None, 1e3, 1e5]))))
    if draw(st.booleans()):
        idx.add("extra", range(draw(st.integers(0, NUM_BLOCKS))))
    # Every queued prefill is committed to d0 (incoming there).
    incoming = tuple(IncomingRequest(j.request_id, j.num_tokens, 50) for p in prefills for j in p.queue)
    decodes = tuple(DecodeInstanceState(f"d{i}", tuple(
        DecodingRequest(f"r{i}{j}", 100, -draw(st.floats(0, 20)), 50) for j in range(draw(st.integers(0, 10)))),
        incoming=incoming if i == 0 else ())
        for i in range(draw(st.integers(1, 3))))
    n_blocks = draw(st.integers(1, NUM_BLOCKS))
    req = ScheduleRequest("r", tuple(range(n_blocks)), n_blocks * BS + draw(st.integers(0, BS - 1)), 20)
    return idx, ClusterState(tuple(prefills), decodes), req, draw(st.sampled_from([1.0, 1.5, 3.0]))


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.sampled_from(["none", "early", "predictive"]))
def test_decision_invariants(scenario, admission):
    idx, clus, req, threshold = scenario
    decisions = {s: schedule(req, clus, index=idx, now=0.0, costs=COSTS,
                             config=cfg(strategy=s, admission=admission, uniform_decode_s=10.0,
                                        kvcache_balancing_threshold=threshold))
                 for s in ("load-balance", "cache-aware", "kvcache-centric")}
    for strategy, d in decisions.items():
        parts = d.predicted_queue_s + d.predicted_prefill_s + d.predicted_transfer_s
        assert abs(d.predicted_ttft_s - parts) < 1e-9
        assert 0 <= d.local_prefix_blocks <= d.reused_prefix_blocks <= len(req.block_keys)
        if d.accepted and admission != "none":
            assert d.predicted_ttft_s <= 1.0 and d.predicted_tbt_s <= 0.1
        if not d.accepted:
            assert d.reason.startswith("rejected: ")
        if d.migration is not None:
            assert strategy == "kvcache-centric" and d.route == "transfer"
            assert d.migration.keys == req.block_keys[d.local_prefix_blocks:d.reused_prefix_blocks]
            assert d.migration.source_store_id == d.transfer_source != d.migration.target_store_id
            assert idx.prefix_len(req.block_keys, d.transfer_source) >= d.reused_prefix_blocks
        elif d.route != "transfer":
            assert d.reused_prefix_blocks == d.local_prefix_blocks
    # cache-aware minimises queue + prefill-with-local-prefix, which load-balance also pays
    assert decisions["cache-aware"].predicted_ttft_s <= decisions["load-balance"].predicted_ttft_s + 1e-12
    # with threshold 1 Algorithm 1 always costs the best prefix, so it reuses at least as much
    # on the chosen instance as the best holder has
    if threshold == 1.0 and decisions["kvcache-centric"].route in ("transfer", "local-hit"):
        assert decisions["kvcache-centric"].reused_prefix_blocks == idx.match(req.block_keys).best_len


def _reference_choice(req, prefills, idx, config, costs):
    """The prefill choice spelled out per instance with the plain helpers (Algorithm 1 lines
    1–16, docs/paper.md §2, for ``kvcache-centric``): (instance id, predicted TTFT) of the first
    instance with the smallest ranking key (the TTFT, but cache-blind for ``load-balance``)."""
    best_len = idx.match(req.block_keys).best_len
    options = []
    for p in prefills:
        model = p.cost or costs.prefill
        queue_s = prefill_queue_time(p, costs, 0.0)
        prefix_len = idx.prefix_len(req.block_keys, p.store_id)
        if config.strategy == "load-balance":   # ranked cache-blind; the prefill still reuses its prefix
            key, ttft = queue_s + model.predict(req.num_tokens, 0), queue_s + model.predict(req.num_tokens, prefix_len * BS)
            options.append((key, p.instance_id, ttft))
            continue
        if config.strategy == "cache-aware" or best_len <= prefix_len or (
                prefix_len and best_len / prefix_len < config.kvcache_balancing_threshold):
            ttft = queue_s + model.predict(req.num_tokens, prefix_len * BS)
        else:
            nbytes = (best_len - prefix_len) * BS * costs.kv_bytes_per_token
            transfer = kv_transfer_time(nbytes, p.bandwidth_bytes_per_s or costs.bandwidth_bytes_per_s,
                                        costs.transfer_latency_s)
            ttft = transfer + queue_s + model.predict(req.num_tokens, best_len * BS)
        options.append((ttft, p.instance_id, ttft))
    _, instance_id, ttft = min(options, key=lambda o: o[0])
    return instance_id, ttft


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.lists(st.sampled_from([None, PrefillCostModel(c1=2e-3), PrefillCostModel(c0=0.05, c1=5e-4)]),
                             min_size=5, max_size=5),
       st.sampled_from(["kvcache-centric", "cache-aware", "load-balance"]), st.sampled_from([0.0, 0.05, 0.5]))
def test_prefill_choice_matches_the_choice_costed_option_by_option(scenario, models, strategy, latency):
    """The prefill choice (which writes the transfer time out in its loop) picks exactly the
    instance and TTFT of the per-instance definition, for every strategy that costs options."""
    idx, clus, req, threshold = scenario
    prefills = tuple(replace(p, cost=m) for p, m in zip(clus.prefills, models))
    config = cfg(strategy=strategy, kvcache_balancing_threshold=threshold)
    costs = replace(COSTS, transfer_latency_s=latency)
    queues = FromScratch.prefill_queues(prefills, costs, 0.0)
    choice = choose_prefill(req, prefills, idx.match(req.block_keys), config, costs, queues)
    assert (choice.instance.instance_id, choice.ttft_s) == _reference_choice(req, prefills, idx, config, costs)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.lists(st.tuples(st.sampled_from([None, 2, 5, 11]), st.sampled_from([None, 500, 1500, 3000]),
                                       st.sampled_from([None, DecodeCostModel(c0=0.02, c1=0.005, c2=1e-5)])),
                             min_size=3, max_size=3),
       st.sampled_from(["none", "early", "predictive"]))
def test_decode_choice_is_the_smallest_tbt_among_instances_with_room(scenario, limits, admission):
    """The decode choice (capacity check and TBT written out in its loop) against the plain
    helpers: the first eligible instance with the smallest TBT, or None when none has room."""
    _, clus, req, _ = scenario
    decodes = tuple(replace(d, max_batch_size=b, max_context_tokens=c, cost=m)
                    for d, (b, c, m) in zip(clus.decodes, limits))
    config = cfg(admission=admission, uniform_decode_s=10.0)
    choice = choose_decode(req, replace(clus, decodes=decodes), config, COSTS, 0.0, 0.5, None)
    if admission == "predictive":
        queues = queues_at(FromScratch.backlogs(clus.prefills, COSTS), 0.0)
        loads = [decode_load_at(d, COSTS, 0.0, 0.5, queues, 10.0) for d in decodes]
    else:
        loads = [decode_load_now(d) for d in decodes]
    options = [(decode_tbt(d, COSTS, b + 1, c + req.num_tokens), i) for i, (d, (b, c)) in enumerate(zip(decodes, loads))
               if decode_has_room(d, req.num_tokens, req.max_output_tokens, b, c)]
    if not options:
        assert choice is None
    else:
        tbt, i = min(options)
        assert (choice.instance, choice.tbt_s, choice.batch_size) == (decodes[i], tbt, loads[i][0] + 1)
