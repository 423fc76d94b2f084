"""mooncake-lite: a KVCache-centric disaggregated LLM serving system in Python."""

import os

# OpenMP threads (torch's, and the C kernels', which share its runtime) sleep between parallel
# regions rather than spin, unless the environment says otherwise. The runtime reads this once, as
# torch loads, so here, before anything imports it: on a shared 2-vCPU box a spinning waiter holds
# the core a descheduled thread needs (docs/model.md, "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
