"""``mooncake bench model``: ``cli.py`` (flags, run, render), ``measure.py`` (one model's prefill and
decode timings against the roofs), ``roofs.py`` (this machine's matmul rate and copy bandwidth),
``flops.py`` (a model's useful work), ``sources.py`` (what a model spec names, which can be
measured here), ``gpu_roofs.py`` (a GPU's datasheet roofs); and ``mooncake bench kv-compression``
(``kv_compression.py``). ``bench pd`` reads the roofs, flops and sources too."""
