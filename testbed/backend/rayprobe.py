"""The link probe between two hosts of a Ray cluster, and `testbed linktest --backend ray`.

Place in the architecture: `testbed.net.probe.measure_link` measures a built link from its two
ends; on one machine each end is a namespace it enters. On a Ray cluster each end is a
`ProbeHost` actor pinned to a node, which runs the same probe roles as children in the node's
own network namespace; `RemoteSide` hands them to `measure_link`, which needs nothing else:

    measure_link(RemoteSide(src node), RemoteSide(dst node), dst_ip, configured)
      udp-server, tcp-sink  -> ProbeHost on the dst node -> python -m testbed.net.proberoles ...
      udp-client, tcp-source -> ProbeHost on the src node -> python -m testbed.net.proberoles ...

No clock is shared by the two ends: RTT is timed on the sender, loss and reordering are counted
at the receiver against the sender's count, goodput is the sender's delivered-bytes slope, and
jitter is the spread of one-way delays, which a constant clock offset does not change
(testbed/net/probe.py). So the same tolerances as `testbed linktest` hold between machines.

`RayBackend.probe` measures the run's `kv` direction through the run's agents. `linktest`
builds the link alone: one shaping agent (`agents.ShapingAgent`, as in a run) on the first node
labelled dc=prfaas and on the first labelled dc=local, each with one instance address
(`PROBE_IPS`) and a route to the other's, shaping its direction; it probes the `kv` direction
(prfaas -> local) and undoes everything in `finally` (the agents' guards and `testbed clean
--backend ray` if this process dies).
"""

import contextlib
import secrets

from testbed.backend import agents
from testbed.backend.raynodes import (DATACENTERS, DIRECTION_OF, READY_TIMEOUT_S, connect,
                                      labelled_nodes, pinned)
from testbed.deploy import DC_NET
from testbed.errors import ConfigError, NetworkError
from testbed.net.calibrate import probe_tries, quiet_probe
from testbed.net.probe import ProbeProcess, measure_link
from testbed.net.tcp import CC_ENV

CALL_MARGIN_S = 30.0        # on top of a probe role's own bound: Ray's round trip, start-up
# One address per datacenter for the probe alone, away from the deployment's plan (10.x.1.y)
PROBE_IPS = {dc: f"{net}.255.254" for dc, net in DC_NET.items()}
STOP_TIMEOUT_S = 30.0


class ProbeHost:
    """Probe roles on this host (a Ray actor pinned to a node), by key."""

    def __init__(self):
        self.procs = {}

    def spawn(self, args, env=None):
        key = len(self.procs)
        self.procs[key] = ProbeProcess(None, *args, env=env)
        return key

    def call(self, key, method, *args):
        """`ProbeProcess.<method>(*args)` of `key`: ready, result, exited, terminate, close."""
        return getattr(self.procs[key], method)(*args)

    def stop(self):
        for p in self.procs.values():
            p.close()


class RemoteSide:
    """One end of a probed link on another host: `spawn` for `measure_link` (`_spawn`)."""

    def __init__(self, ray, actor, env=None):
        self.ray, self.actor, self.env = ray, actor, env

    def spawn(self, *args):
        key = _get(self.ray, self.actor.spawn.remote([str(a) for a in args], self.env),
                   CALL_MARGIN_S)
        return RemoteProbe(self.ray, self.actor, key)


class RemoteProbe:
    """A `ProbeProcess` on another host: the same methods, each one bounded call to it."""

    def __init__(self, ray, actor, key):
        self.ray, self.actor, self.key = ray, actor, key

    def _call(self, method, *args, bound_s=0.0):
        return _get(self.ray, self.actor.call.remote(self.key, method, *args),
                    bound_s + CALL_MARGIN_S)

    def ready(self, what, timeout_s=5.0):
        return self._call("ready", what, timeout_s, bound_s=timeout_s)

    def result(self, what, timeout_s):
        return self._call("result", what, timeout_s, bound_s=timeout_s)

    def exited(self, timeout_s):
        return self._call("exited", timeout_s, bound_s=timeout_s)

    def terminate(self):
        return self._call("terminate")

    def close(self):
        return self._call("close")


def _get(ray, ref, timeout_s):
    """ray.get bounded; a failure on the host (NetworkError there) as one NetworkError here."""
    from ray.exceptions import GetTimeoutError, RayError  # reason: optional [cluster] extra
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise NetworkError(f"a probe host did not answer within {timeout_s:.0f} s") from None
    except RayError as e:
        cause = getattr(e, "cause", None) or e
        raise NetworkError(str(cause).strip().splitlines()[-1]) from None


@contextlib.contextmanager
def probe_sides(ray, src_node, dst_node, congestion_control=None):
    """(src side, dst side): a `ProbeHost` on each node, killed on exit. `congestion_control`:
    the TCP source's ($TESTBED_TCP_CC), None for the host's default."""
    env = {CC_ENV: congestion_control} if congestion_control else None
    hosts = [pinned(ray, ProbeHost, n, num_cpus=0).remote() for n in (src_node, dst_node)]
    try:
        yield tuple(RemoteSide(ray, h, env) for h in hosts)
    finally:
        for h in hosts:
            with contextlib.suppress(Exception):     # gone already: its children died with it
                ray.get(h.stop.remote(), timeout=STOP_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(h)


def measure(ray, src_node, dst_node, dst_ip, configured, congestion_control=None, **kw):
    """`measure_link` from `src_node` to `dst_ip` on `dst_node` (Ray `Node`s), plus where."""
    with probe_sides(ray, src_node, dst_node, congestion_control) as (src, dst):
        result = measure_link(src, dst, dst_ip, configured, **kw)
    result["hosts"] = {"src": src_node.ip, "dst": dst_node.ip, "dst_ip": dst_ip,
                       "clock": "none shared: RTT on the sender, jitter from one-way delay "
                                "spread (offset-free), counts at the receiver"}
    return result


def quiet_measure(ray, src_node, dst_node, dst_ip, link, congestion_control=None, **kw):
    """`measure` of `link` (a `Link`, both ways) judged as the run's probe on one machine is
    (`calibrate.quiet_probe`): measured again once when it warns in a slow spell, told by its
    RTTs' spread (the delay lines are the agents', in other processes)."""
    return quiet_probe(None, lambda: measure(ray, src_node, dst_node, dst_ip, link.params(),
                                             congestion_control, **kw),
                       tries=probe_tries(link), jitter_ms=2 ** 0.5 * 1e3 * link.jitter_s)


# ---------------------------------------------------------------- testbed linktest --backend ray

def probe_nodes(nodes):
    """{dc: the first alive node labelled dc} (sorted by IP); ConfigError if a dc has none."""
    out = {}
    for dc in DATACENTERS:
        found = [n for n in nodes if n.dc == dc]
        if not found:
            raise ConfigError(f"no alive Ray node labelled dc={dc} (ray start ... --labels "
                              f"dc={dc}; docs/cluster.md)", key="--address")
        out[dc] = found[0]
    return out


def linktest(address, link, shaping="auto", duration_s=2.0, congestion_control=None, seed=0):
    """Shape `link` (a checked `Link`, both directions) between a dc=prfaas and a dc=local node
    of the cluster at `address` through shaping agents, measure prfaas -> local, undo.
    Returns measure_link's result with the shaping backend and the agents' interfaces."""
    ray = connect(address)
    nodes = probe_nodes(labelled_nodes(ray.nodes()))
    params = {"kv": link.params(), "request": link.params()}
    run_id = f"linktest-{secrets.token_hex(3)}"
    started = {}
    try:
        refs = {}
        for dc, node in nodes.items():
            other = "local" if dc == "prfaas" else "prfaas"
            started[dc] = pinned(ray, agents.ShapingAgent, node, num_cpus=0).remote(run_id, dc)
            refs[dc] = started[dc].start.remote(
                DIRECTION_OF[dc], f"{DC_NET[other]}.0.0/16", params,
                shaping, seed, [PROBE_IPS[dc]], {PROBE_IPS[other]: nodes[other].ip},
                nodes[other].ip)
        infos = {dc: _get(ray, ref, READY_TIMEOUT_S) for dc, ref in refs.items()}
        result = quiet_measure(ray, nodes["prfaas"], nodes["local"], PROBE_IPS["local"], link,
                               congestion_control, duration_s=duration_s)
    finally:
        errors = _stop_agents(ray, started)
    if errors:
        raise NetworkError("undoing the shaping agents: " + "; ".join(errors))
    info = infos["prfaas"]
    return {"backend": info["backend"], "backend_reason": info["reason"],
            "agents": {dc: {"node": nodes[dc].ip, "iface": i["iface"],
                            "segmentation_offload": i["installed"].get("segmentation_offload")}
                       for dc, i in infos.items()},
            **result}


def _stop_agents(ray, started):
    errors = []
    for dc, agent in started.items():
        try:
            errors += ray.get(agent.stop.remote(), timeout=STOP_TIMEOUT_S)
        except Exception as e:    # its guard process undoes what it did
            errors.append(f"{dc} agent: {type(e).__name__}: {str(e).splitlines()[-1:]}")
        with contextlib.suppress(Exception):
            ray.kill(agent)
    return errors
