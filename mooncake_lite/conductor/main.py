"""``mooncake --role conductor``: the front door (OpenAI API) and the global scheduler.

The flags are in ``config.py``, the app is built by ``app.make_app``; this module runs it through
the roles' one lifecycle (``common/lifecycle.py``).
"""

from __future__ import annotations

import sys

from mooncake_lite.common.lifecycle import Listener, serve_role
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.cluster import discovery
from mooncake_lite.conductor.config import Config


def run(cfg: Config) -> int:
    try:
        app = make_app(cfg)
    except ValueError as exc:
        sys.stderr.write(f"mooncake --role conductor: error: {exc}\n")
        return 2
    return run_loop(lambda: serve_role(app, Listener("conductor", cfg.host, cfg.port, cfg.advertise_host),
                                       on_ready=lambda addresses: discovery.note_address(app, addresses)))
