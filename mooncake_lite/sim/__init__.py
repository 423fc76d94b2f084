"""Trace-driven discrete-event simulator of a Mooncake cluster (and a colocated baseline).

It drives the conductor's own scheduling core (:mod:`mooncake_lite.scheduler`) and the store's
eviction policies (:mod:`mooncake_lite.store.eviction`) with a simulated clock.
"""
