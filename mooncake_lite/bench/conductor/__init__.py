"""``mooncake bench conductor``: ``cli.py`` (parts, flags), ``decision.py`` (one scheduling decision, timed),
``steady.py`` (the conductor's own state at steady load), ``live.py`` (the API's added latency)."""
