"""Backends: where a `testbed.deploy.Deployment` runs. The seam between describing a run and
running it.

    describe (config) -> deploy (Deployment) -> backend: build, run, measure -> analyse -> plot

A backend takes a deployment and the run's teardown `Registry` and event log, and gives the
runner (testbed/run.py) what it drives:

- `start()`: build what the deployment needs (hosts, network, WAN shaping), registering how to
  tear each part down in the registry as it is made; returns the backend;
- `spawn(host, argv, log_path, env)`: start a process placed on the deployment's instance
  `host`; returns a `subprocess.Popen`-like handle (poll, wait, terminate, kill, pid,
  returncode, send_signal), its PID on record in the registry;
- `shaper`: the WAN link model in force (`set(direction, **changes)` for the link schedule,
  `stats()` for the counter sampler, `backend`, `backend_reason`);
- `describe()`: what metadata.json records of the built system (versions, topology,
  segmentation offload, shaping);
- `probe(congestion_control)`: the WAN measured as built (link_fidelity);
- `tcp_counters()`: each host's kernel TCP counters now ({host: {TCPTimeouts, TCPLossProbes,
  RetransSegs}}; `testbed.fidelity`), read before and after the requests;
- `forward(host, port, listen_port)`: a TCP relay from 127.0.0.1:`listen_port` of the machine
  running the testbed (0: a free port) to `host`'s `port`, torn down with the registry; its
  `address` is what it listens on (`testbed up`);
- `cli()`: an interactive shell on the running system, where the backend has one;
- `clocks()`: metadata.json's `clocks`: each host's wall clock against the orchestrator's, as
  measured (`testbed.clocks`; Mininet: one clock, offsets 0), and the host of each instance;
- `stop()`: tear down (also registered with the registry by `start`).

Nothing above this package imports Mininet or Ray: the backends' modules import them only when
a run asks for that backend (`backend.kind` in the experiment). `mininet`
(testbed/backend/mininet.py): one machine, a Mininet host per instance, the WAN shaped on a
router host. `ray` (testbed/backend/raycluster.py): the hosts of a Ray cluster, instances placed
by the hosts' `dc` label, the WAN shaped on each host's NIC by a shaping agent
(testbed/backend/agents.py; docs/cluster.md).
"""

from typing import Protocol

from testbed import eventloop
from testbed.backend.mininet import MininetBackend
from testbed.backend.raycluster import RayBackend
from testbed.backend.rayplacement import preflight as ray_preflight

BACKENDS = ("mininet", "ray")


class Backend(Protocol):
    name: str

    def start(self) -> "Backend": ...

    def spawn(self, host, argv, log_path, env=None): ...

    @property
    def shaper(self): ...

    def describe(self) -> dict: ...

    def probe(self, congestion_control) -> dict: ...

    def tcp_counters(self) -> dict: ...

    def forward(self, host, port, listen_port=0): ...

    def cli(self) -> None: ...

    def clocks(self) -> dict: ...

    def stop(self) -> None: ...


def open_backend(name, deployment, registry, events, spec=None, run_dir=None):
    """The backend `name` for one deployment (not started); `spec`: the experiment's
    `backend:` section (config.BackendSpec); `run_dir`: the run directory (the ray backend's
    hosts without it get their own copy, collected at the end)."""
    if name == "mininet":
        return MininetBackend(deployment, registry, events)
    if name == "ray":
        return RayBackend(deployment, registry, events, spec, run_dir)
    raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")


def preflight(spec, deployment):
    """Check, before anything is made, that the backend can run `deployment` (ray: the extra
    is installed, the cluster answers, the placement can be met) and that `TESTBED_LOOP`
    names an event loop (testbed/eventloop.py); ConfigError otherwise."""
    eventloop.kind()
    if spec.kind == "ray":
        ray_preflight(spec, deployment)
