"""The conductor's flags (``mooncake --role conductor --help``): one frozen dataclass, validated."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass

from mooncake_lite.common.config import ConfigError, option, require
from mooncake_lite.common.membership import conductor_urls
from mooncake_lite.common.roles import RoleConfig
from mooncake_lite.common.units import parse_duration
from mooncake_lite.model.source import DEFAULT_MODEL
from mooncake_lite.scheduler import ADMISSIONS, STRATEGIES, SchedulerConfig
from mooncake_lite.scheduler.arrivals import DEFAULT_WINDOW_S
from mooncake_lite.scheduler.tenants import Tenants, parse_tenants

DESCRIPTION = ("Conductor: serves the OpenAI-compatible API, keeps cluster membership and the global "
               "block index, and places each request on a prefill and a decode instance "
               "(KVCache-centric scheduling, SLO-aware admission).")


def _optional_duration(value):
    return None if value is None else parse_duration(value)


def load_tenants(value: object) -> Tenants:
    """``--tenants``: a table (``[conductor.tenants.NAME]`` in the config file) or the path of a
    TOML file whose ``[tenants]`` table holds them (keys kept in a file of their own, mode 0600)."""
    if isinstance(value, Tenants):
        return value
    if isinstance(value, Mapping):
        return parse_tenants(value)
    try:
        with open(str(value), "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read the tenants file: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{value} is not valid TOML: {exc}") from None
    if "tenants" not in data:
        raise ConfigError(f"{value} has no [tenants] table")
    return parse_tenants(data["tenants"])


@dataclass(frozen=True)
class Config(RoleConfig):
    port: int = option(8000, "HTTP port of the public API and the internal endpoints (0 = any free port)")
    model: str = option(DEFAULT_MODEL, "model served: a named real model, a GGUF file, a checkpoint "
                        "directory or a preset name (instances must match)")
    strategy: str = option("kvcache-centric", "prefill placement strategy", choices=STRATEGIES)
    admission: str = option("predictive", "overload admission: none, early (decode load now, requests "
                            "dispatched there included) or "
                            "predictive (decode load when prefill ends)", choices=ADMISSIONS)
    ttft_slo: float | None = option(None, "absolute TTFT SLO (e.g. 30s, 500ms); replaces --ttft-slo-factor "
                                    "(default: relative)", parse=_optional_duration)
    tbt_slo: float | None = option(None, "absolute TBT SLO (e.g. 200ms); replaces --tbt-slo-factor "
                                   "(default: relative)", parse=_optional_duration)
    ttft_slo_factor: float = option(10.0, "relative TTFT SLO without --ttft-slo: at most this many times "
                                    "the prompt's prefill alone on the chosen instance, by its own profile")
    tbt_slo_factor: float = option(5.0, "relative TBT SLO without --tbt-slo: at most this many times one "
                                   "decode step of the request alone on the chosen instance, by its own profile")
    ttft_admit_margin: float = option(0.0, "refuse on TTFT only when the prediction is over the SLO by more "
                                      "than this share of it (0: at the SLO; measured, docs/scheduler.md)")
    kvcache_balancing_threshold: float = option(
        1.5, "ratio best_len/local_len at or above which a prefill instance fetches the best prefix "
             "from another store (Algorithm 1)")
    burst_window: float = option(DEFAULT_WINDOW_S, "a request arriving while every prefill has a job waits up to "
                                 "this long for the rest of its burst, so all are placed shortest first, each "
                                 "priced knowing the others (0: each as it comes; docs/scheduler.md)",
                                 parse=parse_duration)
    uniform_decode: float | None = option(None, "assumed decode duration t_d per request for predictive "
                                          "admission (None: max_tokens x current TBT)",
                                          parse=_optional_duration)
    api_key: str | None = option(None, "API key clients must send as 'Authorization: Bearer KEY' (with --tenants: "
                                 "one more key, tenant 'default')")
    tenants: Tenants = option(Tenants(), "tenants: API keys -> their SLOs, priority, rate and concurrency limits; "
                              "[conductor.tenants.NAME] tables in the config file, or a TOML file with "
                              "[tenants.NAME] tables (docs/conductor.md, Tenants)", parse=load_tenants)
    dead_after: float = option(10.0, "an instance or store silent this long is marked dead (a dead store's "
                               "blocks leave the index)", parse=parse_duration)
    dead_after_failures: int = option(3, "refused or broken connections in a row that mark an instance dead "
                                      "(the first makes it suspect: not scheduled while others are trusted)")
    dispatch_retries: int = option(2, "times a request that fails before its first token is sent again to "
                                   "other instances (0: never)")
    # 2: a request survives its decode failing and, while it is continued, the next one too; a
    # request that itself crashes decodes (a poison input) takes at most three down (docs/operations.md).
    migration_limit: int = option(2, "times a request whose decode fails mid-stream is continued on another "
                                  "decode (prompt + the tokens already sent); then the client gets the error "
                                  "(0: never)")
    upstream_timeout: float = option(300.0, "longest wait for a prefill result or a decode token",
                                     parse=parse_duration)
    kv_timeout: float = option(30.0, "how long decode waits for a request's KV to arrive", parse=parse_duration)
    seed: int = option(0, "seed of the random strategy")
    reasoning_parser: str = option("none", "think: a chat answer's reasoning between <think> and </think> (Qwen3, "
                                   "DeepSeek-R1 distills) goes to message.reasoning_content / "
                                   "delta.reasoning_content, the rest to content; none: all of it is content",
                                   choices=("none", "think"))
    tool_call_parser: str = option("hermes", "the served model's tool-call format, which chat answers' tool "
                                   "calls are parsed from and tool_choice required/named are forced in: "
                                   "hermes (<tool_call> JSON: Hermes, Qwen) or llama3_json (Llama 3.1+)",
                                   choices=("hermes", "llama3_json"))
    context_quota: int = option(1 << 20, "most tokens of cached contexts (POST /v1/contexts) one tenant may "
                                "hold pinned in the stores at once")
    context_ttl: float = option(3600.0, "a cached context's lifetime when its creator names none",
                                parse=parse_duration)
    context_max_ttl: float = option(7 * 86400.0, "the longest lifetime a cached context may be given (at "
                                    "creation or by extending it)", parse=parse_duration)
    # Hot blocks copied ahead of need (conductor/cluster/hot_replication.py, scheduler/hot.py)
    hot_replication_share: float = option(0.1, "share of each store link's time spent copying hot prefix blocks, "
                                          "in the background, to the live prefill nodes' stores that lack them "
                                          "(0: off)")
    hot_threshold: int = option(3, "requests within --hot-window that must reuse a block before it is hot "
                                "(replicated ahead of need)")
    hot_window: float = option(60.0, "how long a request's reuse of a block counts towards its heat",
                               parse=parse_duration)
    hot_replication_period: float = option(1.0, "how often hot blocks are planned and copied (each link's budget: "
                                           "share x its speed x this period)", parse=parse_duration)
    rebuild_wait: float | None = option(None, "after a start, /health answers 503 until the view is rebuilt: with "
                                        "--discovery until every instance and store listed in etcd has reported "
                                        "(at most this long; default 10s), without it for this long (default 0)",
                                        parse=parse_duration)
    peers: str | None = option(None, "without --discovery: every conductor of the cluster (URL1,URL2,..., this one "
                               "included, as the others reach it); each holds its share of the tenant limits, divided "
                               "among those answering /health")
    shared_instances: str = option("auto", "whether other conductors send work to these instances too (several "
                                    "conductors): on, each conductor counts their work from the instances' heartbeats "
                                    "and breaks ties in its own random order; auto: on with --discovery or --peers",
                                    choices=("auto", "on", "off"))

    @property
    def peer_urls(self) -> tuple[str, ...]:
        return conductor_urls(self.peers, "--peers")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.peers is None or self.discovery is None, "--peers and --discovery exclude each other (with "
                "--discovery the conductors find each other in etcd)")
        try:
            peers = self.peer_urls
        except ValueError as exc:   # conductor_urls': names the bad URL
            raise ConfigError(str(exc)) from None
        require(self.peers is None or bool(peers), "--peers must name at least one conductor URL")
        require(self.rebuild_wait is None or self.rebuild_wait >= 0,
                f"--rebuild-wait must be >= 0, got {self.rebuild_wait}")
        require(0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}")
        require(bool(self.model), "--model must not be empty")
        require(self.ttft_slo is None or self.ttft_slo > 0, f"--ttft-slo must be positive, got {self.ttft_slo}")
        require(self.tbt_slo is None or self.tbt_slo > 0, f"--tbt-slo must be positive, got {self.tbt_slo}")
        require(self.ttft_slo_factor >= 1, f"--ttft-slo-factor must be >= 1, got {self.ttft_slo_factor}")
        require(0 <= self.ttft_admit_margin < 1, f"--ttft-admit-margin must be in [0, 1), got {self.ttft_admit_margin}")
        require(self.tbt_slo_factor >= 1, f"--tbt-slo-factor must be >= 1, got {self.tbt_slo_factor}")
        require(self.kvcache_balancing_threshold >= 1.0,
                f"--kvcache-balancing-threshold is a ratio >= 1, got {self.kvcache_balancing_threshold}")
        require(0 <= self.burst_window <= 1, f"--burst-window must be between 0 and 1s, got {self.burst_window}")
        require(self.uniform_decode is None or self.uniform_decode > 0,
                f"--uniform-decode must be positive, got {self.uniform_decode}")
        require(self.api_key is None or bool(self.api_key), "--api-key must not be empty")
        require(self.dead_after > 0, f"--dead-after must be positive, got {self.dead_after}")
        require(self.dead_after_failures >= 1,
                f"--dead-after-failures must be at least 1, got {self.dead_after_failures}")
        require(self.dispatch_retries >= 0, f"--dispatch-retries must be >= 0, got {self.dispatch_retries}")
        require(self.migration_limit >= 0, f"--migration-limit must be >= 0, got {self.migration_limit}")
        require(self.upstream_timeout > 0, f"--upstream-timeout must be positive, got {self.upstream_timeout}")
        require(self.kv_timeout > 0, f"--kv-timeout must be positive, got {self.kv_timeout}")
        require(self.context_quota >= 0, f"--context-quota must be >= 0, got {self.context_quota}")
        require(0 <= self.hot_replication_share <= 1,
                f"--hot-replication-share must be in [0, 1], got {self.hot_replication_share}")
        require(self.hot_threshold >= 1, f"--hot-threshold must be at least 1, got {self.hot_threshold}")
        require(self.hot_window > 0, f"--hot-window must be positive, got {self.hot_window}")
        require(self.hot_replication_period > 0,
                f"--hot-replication-period must be positive, got {self.hot_replication_period}")
        require(0 < self.context_ttl <= self.context_max_ttl,
                f"--context-ttl must be in (0, --context-max-ttl], got {self.context_ttl}")

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings from these flags (each tenant's SLOs are applied over them)."""
        return SchedulerConfig(strategy=self.strategy, admission=self.admission, ttft_slo_s=self.ttft_slo,
                               tbt_slo_s=self.tbt_slo, ttft_slo_factor=self.ttft_slo_factor,
                               tbt_slo_factor=self.tbt_slo_factor, ttft_admit_margin=self.ttft_admit_margin,
                               kvcache_balancing_threshold=self.kvcache_balancing_threshold,
                               block_size=self.block_size, uniform_decode_s=self.uniform_decode)
