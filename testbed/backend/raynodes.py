"""Access to a Ray cluster: connect to it, list its labelled nodes, pin an actor to one.

Place in the architecture: the bottom of the Ray backend. `raycluster.RayBackend` (a run's
instances on the cluster), `rayplacement` (which node runs which instance) and `rayprobe` (the
link probe between two hosts, `testbed linktest --backend ray`) all reach the cluster through
this module, and it imports none of them:

    raynodes (connect, Node, pinned) <- rayplacement <- raycluster
                                     <- rayprobe     <-

Hosts join the cluster with `ray start ... --labels dc=prfaas` or `dc=local` (docs/cluster.md);
a node counts only when it is alive and carries one of those labels. Ray is the `[cluster]`
extra: `connect` imports it, and says how to install it when it is missing (ConfigError, exit 2).
"""

from __future__ import annotations

import dataclasses
import socket

from testbed.errors import ConfigError

LABEL = "dc"
DATACENTERS = ("prfaas", "local")
DIRECTION_OF = {"prfaas": "kv", "local": "request"}   # the direction a DC's hosts send
READY_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0
NAMESPACE = "prfaas-testbed"


def connect(address):
    """`ray` connected to the cluster at `address` (HOST:PORT or auto); ConfigError (exit 2)
    without the [cluster] extra or without a cluster there."""
    try:
        import ray  # reason: optional [cluster] extra, heavy
    except ImportError:
        raise ConfigError("the ray backend needs Ray: pip install -e '.[cluster]'",
                          key="backend.kind") from None
    if not ray.is_initialized():
        _check_reachable(address)
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                     logging_level="ERROR", configure_logging=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"no Ray cluster at {address} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})",
                              key="backend.address") from None
    return ray


def _check_reachable(address, timeout_s=CONNECT_TIMEOUT_S):
    """A bounded TCP connect to the head's GCS port: ray.init itself retries for minutes."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"no Ray head answers at {address} within {timeout_s:g}s "
                          f"({e.strerror or e})", key="backend.address") from None


@dataclasses.dataclass(frozen=True)
class Node:
    """An alive Ray node with a `dc` label."""

    node_id: str
    ip: str
    dc: str
    cpus: float
    gpus: float


def labelled_nodes(ray_nodes):
    """`Node`s of `ray.nodes()` entries that are alive and carry a known `dc` label."""
    out = []
    for n in ray_nodes:
        dc = (n.get("Labels") or {}).get(LABEL)
        if n.get("Alive") and dc in DATACENTERS:
            r = n.get("Resources") or {}
            out.append(Node(n["NodeID"], n["NodeManagerAddress"], dc, float(r.get("CPU", 0)),
                            float(r.get("GPU", 0))))
    return sorted(out, key=lambda n: (n.dc, n.ip, n.node_id))


def pinned(ray, cls, node, **options):
    """`cls` as a Ray actor class that runs on `node` (a `Node`, or a Ray node ID) only."""
    from ray.util.scheduling_strategies import (  # reason: optional [cluster] extra, heavy
        NodeAffinitySchedulingStrategy)
    node_id = node if isinstance(node, str) else node.node_id
    return ray.remote(cls).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)
