from dataclasses import dataclass

import pytest

from mooncake_lite.common.config import ConfigError, load_config, option, require
from mooncake_lite.common.roles import RoleConfig
from mooncake_lite.common.units import parse_duration, parse_size


@dataclass(frozen=True)
class DemoConfig(RoleConfig):
    port: int = option(8100, "port")
    dram: int = option(1 << 30, "DRAM bytes", parse=parse_size)
    policy: str = option("lru", "eviction", choices=("lru", "lfu"))
    ssd_dir: str | None = option(None, "SSD dir")

    def __post_init__(self):
        super().__post_init__()
        require(self.dram > 0, f"--dram must be positive, got {self.dram}")


def load(argv, env=None):
    return load_config(DemoConfig, argv, prog="t", section="store", env=env or {})


def test_defaults_and_flags():
    cfg = load(["--dram", "2GiB", "--policy", "lfu", "--ssd-dir", "/tmp/x"])
    assert cfg.dram == 2 << 30 and cfg.policy == "lfu" and cfg.ssd_dir == "/tmp/x" and cfg.port == 8100


def test_precedence_flag_over_env_over_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[cluster]\nblock_size = 16\n[store]\nport = 1\ndram = "1MiB"\npolicy = "lfu"\n')
    cfg = load(["--config", str(f), "--port", "3"], env={"MOONCAKE_PORT": "2", "MOONCAKE_DRAM": "2MiB"})
    assert (cfg.port, cfg.dram, cfg.policy, cfg.block_size) == (3, 2 << 20, "lfu", 16)


@pytest.mark.parametrize("argv, needle", [
    (["--dram", "-5"], "--dram must be positive"),
    (["--dram", "lots"], "not a size"),
    (["--block-size", "0"], "--block-size must be positive"),
    (["--port", "x"], "--port"),
])
def test_bad_values_are_clear(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        load(argv)


def test_bad_env_names_its_source():
    with pytest.raises(ConfigError, match="MOONCAKE_DRAM"):
        load([], env={"MOONCAKE_DRAM": "-"})


def test_unknown_toml_key_and_missing_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[store]\nbogus = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load(["--config", str(f)])
    with pytest.raises(ConfigError, match="no such file"):
        load(["--config", str(tmp_path / "none.toml")])


def test_frozen():
    cfg = load([])
    with pytest.raises(Exception):
        cfg.port = 1


def test_units():
    assert parse_size("64KiB") == 65536 and parse_size("1.5GB") == 1_500_000_000
    assert parse_duration("500ms") == 0.5 and parse_duration("2") == 2.0
    with pytest.raises(ValueError):
        parse_size("5 parsecs")
