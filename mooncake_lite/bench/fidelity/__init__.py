"""``mooncake bench fidelity``: ``cli.py`` (flags, run: live, simulate, compare), ``live.py`` (the
cluster, the replay and what is scraped and exported around it), ``sim.py`` (the same slice
simulated), ``gaps.py`` (the measured modelling gaps), ``report.py`` (errors, CDFs, the table)."""
