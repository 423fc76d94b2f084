"""``mooncake bench store``: ``cli.py`` (flags, run, render), ``measure.py`` (one size against a live
store), ``summary.py`` (figures and goals), ``limits.py`` (memcpy and socket ceilings), ``floor.py``
(one round trip's floor); ``--link`` runs ``link/store.py``."""
