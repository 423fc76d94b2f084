"""What start-up imports: the supervisor (`mooncake up`) plans the cluster without torch, and an
instance builds its model without torch._dynamo (torch's compiler, ~1,100 modules and ~1.6 s of
CPU pulled in by a meta-device op or torch.nn.attention): a restart under systemd and every test
that starts a process would pay for them."""

import subprocess
import sys


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]


def test_planning_a_cluster_does_not_import_torch():
    _run("import sys; from mooncake_lite.cluster.up import main; from mooncake_lite.cluster.plan import kv_layout; "
         "assert 'torch' not in sys.modules, 'mooncake up imported torch'")


def test_an_instance_builds_and_runs_its_model_without_torch_dynamo():
    _run("import sys; import mooncake_lite.prefill.main, mooncake_lite.decode.main; "
         "from mooncake_lite.model.weights import build_model; "
         "from mooncake_lite.model.generate import reference_greedy; "
         "reference_greedy(build_model('tiny', seed=0), list(range(1, 70)), 2); "
         "reference_greedy(build_model('tiny-mla', seed=0), list(range(1, 70)), 2); "
         "assert 'torch._dynamo' not in sys.modules, 'an instance imported torch._dynamo'")
