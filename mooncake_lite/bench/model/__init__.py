"""``mooncake bench model`` (``cli.py``: flags, run, render; ``measure.py``: the timings; ``flops.py``:
the model's work and the machine's roofs; ``gpu_roofs.py``) and ``mooncake bench kv-compression``."""
