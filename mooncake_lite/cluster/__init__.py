"""``mooncake up``: a one-machine cluster, each role in its own supervised process."""
