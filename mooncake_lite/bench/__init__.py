"""``mooncake bench ...``: benchmarks that print ratios against this machine's own limits."""
