"""Benchmarks across a shaped link between two network namespaces (``bench store --link``, ``bench
pd --link``): ``measure.py`` (link share, qdisc counters, the parent's side of a worker),
``store.py`` and ``pd.py`` (the two benchmarks and their worker coroutines), ``worker.py`` (the
entry point run inside a node, which imports those two; they never import it)."""
