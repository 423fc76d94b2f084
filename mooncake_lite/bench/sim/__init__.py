"""``mooncake bench sim-scale`` (``scale.py``): the simulator on a million-request trace."""
