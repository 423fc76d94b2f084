"""Reading what a systemd unit runs (tests/netns/units.py), as systemd would."""

from __future__ import annotations

from tests.netns.units import read_unit

UNIT = """[Unit]
Description=x
ExecStart=/not/this
[Service]
Type=notify
# a comment
Environment=PYTHONUNBUFFERED=1 "GREETING=hello world"
EnvironmentFile=-/etc/missing.env
EnvironmentFile=/etc/mooncake/mooncake.env
ExecStart=-/opt/mooncake/.venv/bin/mooncake --role store \\
    --config=/etc/mooncake/mooncake.toml --cluster-token ${MOONCAKE_CLUSTER_TOKEN} --log-level $LEVEL
WatchdogSec=30s
"""


def test_exec_start_and_environment_as_systemd_reads_them(tmp_path):
    unit, env = tmp_path / "x.service", tmp_path / "x.env"
    unit.write_text(UNIT)
    env.write_text("# secrets\nMOONCAKE_CLUSTER_TOKEN=s3cret\nLEVEL='debug'\n")
    read = read_unit(unit, {"/etc/mooncake/mooncake.env": str(env), "/etc/mooncake/mooncake.toml": "/here/m.toml"})
    assert read.exec_start == ("/opt/mooncake/.venv/bin/mooncake", "--role", "store", "--config=/here/m.toml",
                               "--cluster-token", "s3cret", "--log-level", "debug")
    assert read.env == {"PYTHONUNBUFFERED": "1", "GREETING": "hello world", "MOONCAKE_CLUSTER_TOKEN": "s3cret",
                        "LEVEL": "debug"}
