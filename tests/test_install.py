"""What a plain `pip install .` leaves out is refused cleanly: torch is an extra
(docs/install.md), so an experiment asking for the torch engine's model without torch gets exit
2 and one line saying how to install it."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
sys.meta_path.insert(0, NoTorch())
from testbed.cli import main
sys.exit(main(["workload", "experiments/torch_small.yaml"]))
"""


def test_torch_experiment_without_torch_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-c", NO_TORCH], cwd=ROOT, capture_output=True,
                       text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.torch" in lines[0] and "TORCH=cpu or cuda" in lines[0]
