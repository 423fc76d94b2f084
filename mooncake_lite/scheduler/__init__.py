"""Pure scheduling core of the conductor (Algorithm 1, estimators, overload admission).

No IO, no wall clock: the live conductor and the simulator drive the same code. See
docs/scheduler.md for the API and the decisions behind it.
"""

from mooncake_lite.scheduler.admission import decode_admits
from mooncake_lite.scheduler.block_index import BlockEvent, BlockIndex, PrefixMatch
from mooncake_lite.scheduler.config import ADMISSIONS, STRATEGIES, SchedulerConfig
from mooncake_lite.scheduler.costs import (CostModels, DecodeCostModel, PrefillCostModel,
                                           kv_bytes_per_token, kv_transfer_time)
from mooncake_lite.scheduler.decision import Decision, Migration
from mooncake_lite.scheduler.estimate import carry_queue_estimates, carry_running_estimates, prefill_queue_time
from mooncake_lite.scheduler.scheduler import Scheduler, schedule
from mooncake_lite.scheduler.state import (MAX_CONTEXT_LAG, ClusterState, DecodeInstanceState, DecodingRequest,
                                           IncomingRequest, PrefillInstanceState, QueuedPrefill,
                                           ScheduleRequest, context_lag_bound)

__all__ = [
    "ADMISSIONS", "MAX_CONTEXT_LAG", "STRATEGIES", "BlockEvent", "BlockIndex", "ClusterState", "CostModels",
    "Decision", "DecodeCostModel", "DecodeInstanceState", "DecodingRequest", "IncomingRequest",
    "Migration", "PrefillCostModel", "PrefillInstanceState", "PrefixMatch", "QueuedPrefill", "ScheduleRequest",
    "Scheduler", "SchedulerConfig", "decode_admits", "kv_bytes_per_token", "kv_transfer_time",
    "carry_queue_estimates", "carry_running_estimates", "context_lag_bound", "prefill_queue_time", "schedule",
]
