"""``mooncake bench pd``: ``cli.py`` (flags, run, render), ``overlap.py`` ((a) layer-wise overlap and
(b) prefix hits, on a ``PrefillRig``), ``cpp.py`` ((c) chunked pipeline parallelism), ``burst.py``
((e) a burst, batched and not, against the conductor's predictions), ``roles.py`` (what the parts
share); and ``mooncake bench prefix-load`` (``prefix_load.py``). ``--link`` runs ``link/pd.py``."""
