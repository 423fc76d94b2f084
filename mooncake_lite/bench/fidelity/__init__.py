"""``mooncake bench fidelity``: ``cli.py`` (flags, run), ``live.py`` (the live side on a started
cluster), ``sim.py`` (the simulated side), ``gaps.py`` (token gaps), ``report.py`` (errors, CDFs, text)."""
