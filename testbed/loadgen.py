"""External load generators, the spec side: `workload.client: command | aiperf | vllm-bench`,
checked before anything is built, and the front door's entry of the workers' runtime.

With an external client the runner starts the OpenAI-compatible front door
(workers/frontdoor.py) in the client host beside the other workers, then, instead of the
built-in client, the tool, in the same host's network namespace (`testbed.loadrun`):

- `command`: `workload.command`, split like a shell (shlex; no shell runs it) with `{url}` (the
  front door's base URL, `http://IP:PORT`), `{model}`, `{trace}` (the run's workload as a
  mooncake trace, timestamps in emulated ms) and `{run_dir}` replaced;
- `aiperf`: `aiperf profile` replaying the trace with `--fixed-schedule` against the front
  door, streaming, with the tokenizer of testbed/tokenizer/ (the front door's own rule);
- `vllm-bench`: `vllm bench serve` (workers/vllm_bench.py in the vLLM venv) sending the
  workload's request count at its mean rate (Poisson), each request the workload's mean input
  and output lengths (its `random` dataset; bench serve cannot replay a schedule).

Three modules, one per phase: this one (spec and check, below `testbed.config`),
`testbed.loadrun` (the launch, at run time) and `testbed.loadstats` (analysis of what the front
door and the tool recorded).
"""

import os
import pathlib
import shlex
import shutil
import sys

from testbed import profile as profiles
from testbed import vllmenv
from testbed.errors import ConfigError
from testbed.runtime import FrontdoorRuntime

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = pathlib.Path(__file__).resolve().parent / "tokenizer"
AIPERF_ENV = "TESTBED_AIPERF"        # path of an aiperf executable (e.g. in its own venv)
AIPERF_EXE = "aiperf"                # its name


def find_aiperf():
    """The aiperf executable: $TESTBED_AIPERF, beside this Python (pip install '.[aiperf]'),
    in the repository's .venv-aiperf (`make aiperf`), or on PATH; None if absent."""
    env = os.environ.get(AIPERF_ENV)
    if env:
        return env if os.access(env, os.X_OK) else None
    for here in (pathlib.Path(sys.executable).parent / AIPERF_EXE,
                 REPO / ".venv-aiperf" / "bin" / AIPERF_EXE):
        if os.access(here, os.X_OK):
            return str(here)
    return shutil.which(AIPERF_EXE)


def check(exp, path=None):
    """A client that cannot start is refused before anything is built (ConfigError)."""
    w = exp.workload
    if w.client == "aiperf" and find_aiperf() is None:
        raise ConfigError(f"client aiperf: aiperf is not installed; pip install '.[aiperf]' "
                          f"(or name its executable in ${AIPERF_ENV})", path=path,
                          key="workload.client")
    if w.client == "vllm-bench" and vllmenv.find_python() is None:
        raise ConfigError(f"client vllm-bench: {vllmenv.INSTALL_HINT}", path=path,
                          key="workload.client")
    if w.client == "command":
        exe = shlex.split(w.command)[0]
        if shutil.which(exe) is None:
            raise ConfigError(f"command {exe!r} not found (not an executable file or on PATH)",
                              path=path, key="workload.command")


def runtime(exp):
    """The front door's entry in runtime.json."""
    f = exp.workload.frontdoor
    return FrontdoorRuntime(port=f.port, max_context=f.max_context, model=profiles.model_name(exp.model.profile))


def url(rt):
    return f"http://{rt.instance('client').ip}:{rt.frontdoor.port}"
