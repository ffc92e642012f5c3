"""Placement on a Ray cluster: which labelled node runs each instance of a deployment (pure).

Place in the architecture: between cluster access (`raynodes`: the alive labelled `Node`s) and
launching (`raycluster.RayBackend`, which starts a launcher per placed node holding its
instances' CPUs and GPUs). `place` puts every instance on a node labelled with its datacenter:
the node with the most free CPUs that fits, one GPU per prefill/decode instance for the torch
engine on CUDA, `backend.cpus` CPUs otherwise. A datacenter without a node, or instances that
do not fit, is a ConfigError (exit 2) before anything starts; `preflight` runs the same check
before the run directory is made (`testbed.backend.preflight`).
"""

from __future__ import annotations

from testbed.backend.raynodes import DATACENTERS, LABEL, connect, labelled_nodes
from testbed.errors import ConfigError


def request(inst, runtime, cpus):
    """(CPUs, GPUs) an instance asks for: a GPU for the torch engine's prefill and decode on
    CUDA, `cpus` otherwise."""
    if inst.role in ("prefill", "decode") and runtime.engine == "torch" \
            and runtime.device == "cuda":
        return 0.0, 1.0
    return cpus, 0.0


def place(deployment, cpus, nodes):
    """{instance name: Node}; ConfigError naming what cannot be met."""
    free = {n: [n.cpus, n.gpus] for n in nodes}
    for dc in DATACENTERS:
        if not any(n.dc == dc for n in nodes):
            raise ConfigError(f"no alive Ray node labelled {LABEL}={dc} (ray start ... "
                              f"--labels {LABEL}={dc}; docs/cluster.md)", key="backend")
    out = {}
    for inst in deployment.instances:
        need_cpu, need_gpu = request(inst, deployment.runtime, cpus)
        fits = [n for n in nodes if n.dc == inst.dc and free[n][0] >= need_cpu - 1e-9
                and free[n][1] >= need_gpu - 1e-9]
        if not fits:
            total = [sum(free_n[i] for n, free_n in free.items() if n.dc == inst.dc)
                     for i in (0, 1)]
            raise ConfigError(f"placement cannot be met: {inst.name} (dc={inst.dc}) needs "
                              f"{need_cpu:g} CPU and {need_gpu:g} GPU, the nodes labelled "
                              f"{LABEL}={inst.dc} have {total[0]:g} CPU and {total[1]:g} GPU "
                              f"left", key="backend")
        best = max(fits, key=lambda n: (free[n][1] if need_gpu else free[n][0], n.ip))
        free[best][0] -= need_cpu
        free[best][1] -= need_gpu
        out[inst.name] = best
    return out


def _check_path_limits(deployment):
    """mtu and police are the WAN router's (`testbed.net.pathlimit`); Ray shapes on the hosts."""
    for key in ("mtu", "police"):
        if deployment.sets(key):
            raise ConfigError(f"{key} is the WAN router's and the ray backend shapes on the "
                              "hosts, with no router: run it on the mininet backend",
                              key=f"network.wan.{key}")


def preflight(spec, deployment):
    """Connect and place once, before the run directory is made (exit 2 on failure)."""
    _check_path_limits(deployment)
    ray = connect(spec.address)
    return place(deployment, spec.cpus, labelled_nodes(ray.nodes()))
