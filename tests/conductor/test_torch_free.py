"""The conductor runs on a CPU box without torch's weight: it reads model shapes from presets
or config.json (model/checkpoint_config.py) and must never import torch."""

import subprocess
import sys


def test_building_the_conductor_app_does_not_import_torch():
    code = ("import sys; from mooncake_lite.conductor.app import make_app; "
            "from mooncake_lite.conductor.config import Config; make_app(Config()); "
            "assert 'torch' not in sys.modules, 'the conductor imported torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
