"""Pure scheduling core of the conductor (Algorithm 1, estimators, overload admission).

No IO, no wall clock: the live conductor and the simulator drive the same code. See
docs/scheduler.md for the API and the decisions behind it.
"""

from mooncake_lite.scheduler.admission import decode_admits
from mooncake_lite.scheduler.block_index import BlockEvent, BlockIndex, PrefixMatch
from mooncake_lite.scheduler.cache import EstimateCache, FromScratch
from mooncake_lite.scheduler.config import ADMISSIONS, STRATEGIES, SchedulerConfig
from mooncake_lite.scheduler.costs import (CostModels, DecodeCostModel, PrefillCostModel,
                                           kv_bytes_per_token, kv_transfer_time)
from mooncake_lite.scheduler.decision import Decision, Migration
from mooncake_lite.scheduler.estimate import prefill_queue_time
from mooncake_lite.scheduler.scheduler import Scheduler, schedule
from mooncake_lite.scheduler.state import (ClusterState, DecodeInstanceState, DecodingRequest, IncomingRequest,
                                           PrefillInstanceState, QueuedPrefill, ScheduleRequest)
from mooncake_lite.scheduler.view import (MAX_CONTEXT_LAG, MAX_TBT_DRIFT, DecodeView, PrefillView,
                                          context_lag_bound)

__all__ = [
    "ADMISSIONS", "MAX_CONTEXT_LAG", "MAX_TBT_DRIFT", "STRATEGIES", "BlockEvent", "BlockIndex", "ClusterState",
    "CostModels", "Decision", "DecodeCostModel", "DecodeInstanceState", "DecodeView", "DecodingRequest",
    "EstimateCache", "FromScratch", "IncomingRequest", "Migration", "PrefillCostModel", "PrefillInstanceState",
    "PrefillView", "PrefixMatch", "QueuedPrefill", "ScheduleRequest", "Scheduler", "SchedulerConfig",
    "context_lag_bound", "decode_admits", "kv_bytes_per_token", "kv_transfer_time", "prefill_queue_time", "schedule",
]
