"""``mooncake bench store``: ``cli.py`` (flags, the store under test, rounds, render), ``measure.py``
(one round of puts and gets against it: ``StoreRound``), ``summary.py`` (figures, the reference
and the goals), ``limits.py`` (memcpy and socket ceilings; the socket sender's entry point),
``floor.py`` (one round trip's floor). ``--link`` runs ``link/store.py``."""
