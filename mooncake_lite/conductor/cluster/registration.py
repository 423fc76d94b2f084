"""What an instance says about itself — its registration and its heartbeats — checked against the
cluster and told to its scheduler view (``scheduler/view.py``).

A registration is refused (:class:`RegistrationError`) for a role the conductor does not know, a
decode instance without a data address, or a model, block size, hash seed or KV size per token
other than the cluster's. Its cost report, and each heartbeat's, was checked when the message
was decoded; a flat one (an older instance's) is read with the registered role here, and a
heartbeat's report replaces only the models it carries. Pure: no IO, no clock.
"""

from __future__ import annotations

from dataclasses import replace

from mooncake_lite.common.cost_report import CostReport, FlatCost
from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register
from mooncake_lite.conductor.cluster.costs import InstanceCosts, instance_costs
from mooncake_lite.model.source import model_id
from mooncake_lite.scheduler import DecodeView, PrefillView
from mooncake_lite.scheduler.correction_shown import show_start

ROLES = ("prefill", "decode")
# Heartbeat load fields that appear in a scheduler state: a change rebuilds it.
STATE_LOAD_KEYS = ("bandwidth_bytes_per_s", "max_context_tokens", "max_batch_size")


class RegistrationError(Exception):
    """Registration refused: 409 for a cluster mismatch, 400 for a malformed message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check(reg: Register, model: str, block_size: int, hash_seed: int, kv_bytes_per_token: int | None) -> None:
    """Raise RegistrationError unless ``reg`` may join a cluster serving ``model`` (its id) with
    these blocks and hashes (``kv_bytes_per_token``: the other instances', None without any)."""
    if reg.role not in ROLES:
        raise RegistrationError(400, f"role must be one of {', '.join(ROLES)}, got {reg.role!r}")
    if reg.role == "decode" and not reg.data:
        raise RegistrationError(400, "a decode instance must give its data address ('data')")
    mismatches = []
    if model_id(reg.model) != model:
        mismatches.append(f"model {reg.model!r} (conductor serves {model!r})")
    if reg.block_size != block_size:
        mismatches.append(f"block_size {reg.block_size} (cluster uses {block_size})")
    if reg.hash_seed != hash_seed:
        mismatches.append(f"hash_seed {reg.hash_seed} (cluster uses {hash_seed})")
    if kv_bytes_per_token not in (None, reg.kv_bytes_per_token):
        mismatches.append(f"kv_bytes_per_token {reg.kv_bytes_per_token} (other instances use "
                          f"{kv_bytes_per_token}: different dtype?)")
    if mismatches:
        raise RegistrationError(409, f"{reg.role} instance {reg.instance_id} refused: mismatched "
                                     + "; ".join(mismatches))


def registered_costs(reg: Register) -> InstanceCosts:
    """The cost models a registration reports (400 when a flat one does not fit its role)."""
    try:
        return reported_costs(reg.cost, reg)
    except ValueError as exc:
        raise RegistrationError(400, f"{reg.role} instance {reg.instance_id}: {exc}") from None


def heartbeat_costs(reg: Register, costs: InstanceCosts, hb: Heartbeat) -> InstanceCosts:
    """An instance's ``costs`` with what its heartbeat reports in place of what it replaces."""
    if hb.cost is None:
        return costs
    try:
        new = reported_costs(hb.cost, reg)
    except ValueError as exc:
        raise RegistrationError(400, f"{reg.role} instance {reg.instance_id} heartbeat: {exc}") from None
    return InstanceCosts(new.prefill or costs.prefill, new.decode or costs.decode,
                         new.bandwidth_bytes_per_s or costs.bandwidth_bytes_per_s)


def reported_costs(report: CostReport | FlatCost, reg: Register) -> InstanceCosts:
    """The models ``report`` gives an instance that registered ``reg``: a prefill's priced chunk
    by chunk of its registered ``prefill_chunk`` (0, an older instance's: one pass, as before)."""
    costs = instance_costs(report, reg.role)
    if costs.prefill is None or not reg.prefill_chunk:
        return costs
    return replace(costs, prefill=costs.prefill.with_chunk(reg.prefill_chunk))


def new_view(reg: Register, costs: InstanceCosts) -> PrefillView | DecodeView:
    if reg.role == "prefill":
        view = PrefillView(reg.instance_id, None)    # its store: describe
        show_start(view)   # the live conductor always corrects its predictions (flight/predictions.py)
        return view
    return DecodeView(reg.instance_id, costs.decode)


def describe(view: PrefillView | DecodeView, reg: Register, load: InstanceLoad, costs: InstanceCosts) -> None:
    """Tell an instance's view what its registration and last heartbeat (``load``) say."""
    if isinstance(view, PrefillView):
        # No store: a unique id no block event names, so nothing counts as cached there.
        store_id = reg.store if reg.store else f"(no store):{reg.instance_id}"
        bandwidth = costs.bandwidth_bytes_per_s or load.bandwidth_bytes_per_s or None
        view.set_instance(store_id, bandwidth, costs.prefill, max(reg.pack_tokens, 0), max(reg.queue_overtakes, 0))
    else:
        # Register.max_context of a decode instance is its KV capacity in tokens.
        max_context = _int_or_none(load.max_context_tokens) or _int_or_none(reg.max_context)
        view.set_limits(_int_or_none(load.max_batch_size), max_context)


def _int_or_none(value: float | None) -> int | None:
    return int(value) if value is not None and value > 0 else None
