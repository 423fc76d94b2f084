"""A prefill or decode instance started with a bad configuration exits at once with status 2
and one line naming the option — before loading any weights or binding a port."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("args, message", [
    (["--role", "prefill", "--model", "nosuch"], "--model: unknown model preset 'nosuch'"),
    (["--role", "prefill", "--model", "/nonexistent/ckpt"], "checkpoint directory '/nonexistent/ckpt' does not exist"),
    (["--role", "prefill", "--model", "tiny", "--pipeline-group", "99"], "--pipeline-group 99 exceeds the model's 4 layers"),
    (["--role", "decode", "--model", "nosuch"], "--model: unknown model preset 'nosuch'"),
    (["--role", "decode", "--model", "tiny", "--port", "99999"], "--port out of range: 99999"),
    (["--role", "decode", "--model", "tiny", "--num-blocks", "0"], "--num-blocks"),
])
def test_bad_role_configuration_exits_with_a_clear_error(args, message):
    proc = subprocess.run([sys.executable, "-m", "mooncake_lite", *args], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mooncake --role {args[1]}: error: ") and message in last
