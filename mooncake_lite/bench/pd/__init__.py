"""``mooncake bench pd``: ``cli.py`` (flags, run, render), ``overlap.py`` (layer-wise overlap, prefix
hit), ``burst.py`` (a burst against predictions), ``cpp.py`` (chunked pipeline parallelism), ``roles.py``
(what the parts share); ``mooncake bench prefix-load`` (``prefix_load.py``)."""
