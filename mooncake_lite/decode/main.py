"""``mooncake --role decode``: receive KV from prefill, continuous batching, stream tokens.

The flags are in ``config.py``, the engine and app are built in ``app.py``; this module runs the
app through the roles' one lifecycle (``common/lifecycle.py``: serve, register, heartbeat, drain).
"""

from __future__ import annotations

from mooncake_lite.common import sdnotify
from mooncake_lite.common.lifecycle import Listener, Membership, serve_role
from mooncake_lite.common.service import run as run_loop
from mooncake_lite.decode.app import DATA, DecodeAppSettings, build_engine, make_app, registration, reported_cost
from mooncake_lite.decode.config import Config


def run(cfg: Config) -> int:
    sdnotify.notify(f"STATUS=decode loading {cfg.model}")
    engine = build_engine(cfg)
    app = make_app(engine, DecodeAppSettings(cfg.host, cfg.data_port, cfg.cluster_token,
                                             advertise_host=cfg.advertise_host,
                                             data_handshake_timeout=cfg.data_handshake_timeout,
                                             data_stall_timeout=cfg.data_stall_timeout,
                                             data_idle_timeout=cfg.data_idle_timeout or None,
                                             data_inflight=cfg.data_inflight))
    conductor = cfg.joins()
    membership = None if conductor is None else Membership(
        conductor, lambda addresses: registration(cfg, engine, addresses), engine.load, lambda: reported_cost(engine))
    return run_loop(lambda: serve_role(app, Listener("decode", cfg.host, cfg.port, cfg.advertise_host), membership,
                                       extra_addresses=lambda: {"data": app[DATA].address}))
