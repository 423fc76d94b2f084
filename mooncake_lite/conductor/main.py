"""``mooncake --role conductor``: the front door (OpenAI API) and the global scheduler.

The flags are in ``config.py``, the app is built by ``app.make_app``; this module only runs it.
"""

from __future__ import annotations

import sys

from mooncake_lite.common.service import run as run_loop
from mooncake_lite.common.service import serve_app
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config


def run(cfg: Config) -> int:
    try:
        app = make_app(cfg)
    except ValueError as exc:
        sys.stderr.write(f"mooncake --role conductor: error: {exc}\n")
        return 2
    return run_loop(lambda: serve_app(app, cfg.host, cfg.port, role="conductor", advertise_host=cfg.advertise_host))
