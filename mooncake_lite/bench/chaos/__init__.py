"""``mooncake bench chaos``: ``cli.py`` (flags, kills, render) and ``load.py`` (the streaming load and
its figures)."""
