"""``mooncake --role store``: the KV block pool (DRAM slab + SSD tier) and its data port.

The flags are in ``config.py``, the app is built by ``app.make_app``; this module runs it through the
roles' one lifecycle (``common/lifecycle.py``; a store does not register with the conductor).
"""

from __future__ import annotations

import sys

from mooncake_lite.common.lifecycle import Listener, serve_role
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.store.app import DATA, make_app
from mooncake_lite.store.config import Config
from mooncake_lite.transfer.rdma import TransportError, select_transport


def run(cfg: Config) -> int:
    try:
        select_transport(cfg.transport)
    except TransportError as exc:
        sys.stderr.write(f"mooncake --role store: error: {exc}\n")
        return 2
    try:
        app = make_app(cfg)
    except (OSError, ValueError, RuntimeError) as exc:
        sys.stderr.write(f"mooncake --role store: error: cannot set up the store: {exc}\n")
        return 2
    listener = Listener("store", cfg.host, cfg.port, cfg.advertise_host, cfg.drain_timeout)
    return run_loop(lambda: serve_role(app, listener, extra_addresses=lambda: {"data": app[DATA].address}))
