"""The documented TOML format against the real role configs: docs/config.example.toml loads for
every role, and flag > MOONCAKE_* env > file > default holds for a real role."""

import importlib

import pytest

from mooncake_lite.common.config import ConfigError, load_config
from tests.conftest import REPO

EXAMPLE = REPO / "docs" / "config.example.toml"


def role_config(role):
    return importlib.import_module(f"mooncake_lite.{role}.config").Config


def load(role, argv, env=None):
    return load_config(role_config(role), argv, prog=f"mooncake --role {role}", section=role, env=env or {})


@pytest.mark.parametrize("role, port", [("conductor", 8000), ("store", 8100), ("prefill", 8200), ("decode", 8300)])
def test_example_file_loads_for_every_role(role, port):
    cfg = load(role, ["--config", str(EXAMPLE)])
    assert (cfg.host, cfg.port, cfg.block_size, cfg.log_json) == ("10.0.0.11", port, 512, True)
    if role != "conductor":
        assert cfg.conductor == "http://10.0.0.10:8000"    # from [cluster]
    if role == "store":
        assert cfg.dram == 8 << 30 and cfg.data_port == 8101
    if role == "decode":
        assert cfg.tbt_slo == pytest.approx(0.2) and cfg.data_port == 8301


def test_flag_beats_env_beats_file_beats_default(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[cluster]\nblock_size = 16\nlog_level = "debug"\n'
                 '[store]\nport = 9100\ndata_port = 9101\ndram = "64MiB"\nlog_level = "warning"\n')
    cfg = load("store", ["--config", str(f)])
    assert (cfg.port, cfg.data_port, cfg.dram, cfg.block_size) == (9100, 9101, 64 << 20, 16)
    assert cfg.log_level == "warning"                        # [store] overrides [cluster]
    assert cfg.eviction == "lru"                             # default when nobody sets it
    cfg = load("store", ["--config", str(f)], env={"MOONCAKE_PORT": "9200", "MOONCAKE_DRAM": "32MiB"})
    assert (cfg.port, cfg.dram, cfg.data_port) == (9200, 32 << 20, 9101)
    cfg = load("store", ["--config", str(f), "--port", "9300"], env={"MOONCAKE_PORT": "9200"})
    assert cfg.port == 9300


def test_cluster_token_from_env_reaches_every_role(tmp_path):
    for role in ("conductor", "store", "prefill", "decode"):
        assert load(role, [], env={"MOONCAKE_CLUSTER_TOKEN": "s3cret"}).cluster_token == "s3cret"


def test_bad_file_values_name_their_source(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[store]\ndram = "lots"\n')
    with pytest.raises(ConfigError, match="config file"):
        load("store", ["--config", str(f)])
    f.write_text("[decode]\nssd_dir = \"/tmp/x\"\n")            # decode has no SSD tier (a store option)
    with pytest.raises(ConfigError, match="unknown key"):
        load("decode", ["--config", str(f)])
