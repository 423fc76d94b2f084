"""``mooncake bench conductor``: ``cli.py`` (the parts and their flags), ``decision.py`` (one
scheduling decision, timed on a synthetic cluster), ``steady.py`` (the conductor's own snapshot
and decision in a steady state), ``live.py`` (the API's added latency against zero-work instances)."""
