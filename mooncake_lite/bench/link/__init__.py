"""Benchmarks across a shaped link between two network namespaces (``store --link``, ``pd --link``):
``measure.py`` (share, qdisc counters, the parent's side of a worker), ``store.py`` and ``pd.py`` (the
two benchmarks and their workers), ``worker.py`` (the entry point run inside a node)."""
