"""`testbed linktest`: build one shaped WAN link alone and print configured vs measured.

The link is the run's WAN in miniature, built by the same `testbed.net.wan.Wan`
(`testbed.net.pair.routed_pair`, which the root tests and `benchmarks/link_fidelity.py` use too):

    tb<id>s (PrfaaS side) --veth-- tb<id>r (router, shaping both egresses) --veth-- tb<id>d (local)

`src -> dst` is the `kv` direction (egress toward the local side), `dst -> src` the `request`
direction. Everything is recorded in a `Registry` and removed in `finally`, also on Ctrl-C.

`--backend ray --address HOST:PORT` checks the link between two hosts of a Ray cluster instead:
shaping agents on a node labelled dc=prfaas and one labelled dc=local shape it on their NICs as
in a run, the probe runs between them (`testbed.backend.rayprobe`), and the agents undo after.
The same tolerances apply; no clock shared by the hosts is needed (docs/cluster.md).
"""

import json
import os

from testbed import units
from testbed.backend.rayprobe import linktest
from testbed.errors import ConfigError, PrivilegeError
from testbed.net.calibrate import probe_tries, quiet_probe
from testbed.net.linkmodel import check_params
from testbed.net.pair import routed_pair
from testbed.net.probe import measure_link
from testbed.net.spec import _queue
from testbed.net.tcp import CC_ENV


def direction_params(rate, delay, jitter, loss, queue, jitter_dist="normal", loss_burst=None,
                     **steady):
    """One symmetric direction's checked `Link` from command-line strings (units as in the
    YAML)."""
    try:
        q = None if queue is None else _queue(queue)
    except ValueError as e:
        raise ConfigError(str(e), key="--queue") from None
    return check_params({"rate": rate, "delay": delay, "jitter": jitter, "loss": loss,
                         "queue": q, "jitter_dist": jitter_dist, "loss_burst": loss_burst,
                         **{k: v for k, v in steady.items() if v is not None}},
                        "linktest")


def register(sub):
    p = sub.add_parser("linktest", help="build one shaped link alone, print configured vs measured"
                                        " (root)")
    p.add_argument("--rate", default="100Mbit", help="link rate (default 100Mbit)")
    p.add_argument("--delay", default="5ms", help="one-way delay (default 5ms)")
    p.add_argument("--jitter", default="0ms", help="one-way delay std dev (default 0)")
    p.add_argument("--loss", default="0", help="random loss, e.g. 1%% (default 0)")
    p.add_argument("--loss-burst", default=None,
                   help="mean loss burst in packets (Gilbert model; default: independent)")
    p.add_argument("--corrupt", default=None, help="probability a packet gets a bit flipped")
    p.add_argument("--duplicate", default=None, help="probability a packet is sent twice")
    p.add_argument("--reorder", default=None, dest="reorder_prob",
                   help="probability a packet is sent ahead of those held (netem's reorder)")
    p.add_argument("--reorder-gap", default=None, help="netem's gap (default 1)")
    p.add_argument("--mtu", default=None, help="path MTU at the router, bytes (552..1500)")
    p.add_argument("--no-mtu-icmp", action="store_false", dest="mtu_icmp", default=None,
                   help="drop above --mtu without ICMP fragmentation-needed (PMTU blackhole)")
    p.add_argument("--police", default=None, help="token-bucket policer rate, e.g. 50Mbit")
    p.add_argument("--police-burst", default=None,
                   help="the policer's bucket, bytes (default 10 ms of its rate)")
    p.add_argument("--queue", default=None, help="drop-tail queue, bytes or '100p' (default BDP)")
    p.add_argument("--shaping", default="auto", choices=("auto", "netem", "userspace"),
                   help="the shaping backend (default auto: netem where the kernel has it)")
    p.add_argument("--backend", default="mininet", choices=("mininet", "ray"),
                   help="mininet: namespaces of this machine (default); ray: between two hosts "
                        "of a Ray cluster (docs/cluster.md)")
    p.add_argument("--address", default="auto", metavar="HOST:PORT",
                   help="ray: the Ray head (default: auto)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds of bulk TCP (default 2)")
    p.add_argument("--cc", default=None, choices=("cubic", "bbr", "reno"),
                   help="TCP congestion control of the two hosts (default: the machine's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def main(args):
    d = direction_params(args.rate, args.delay, args.jitter, args.loss, args.queue,
                         loss_burst=args.loss_burst, corrupt=args.corrupt,
                         duplicate=args.duplicate, reorder_prob=args.reorder_prob,
                         reorder_gap=args.reorder_gap, mtu=args.mtu, mtu_icmp=args.mtu_icmp,
                         police=args.police, police_burst=args.police_burst)
    if args.backend == "ray":
        out = _on_ray(args, d)
    else:
        out = _on_this_machine(args, d)
    if args.json:
        print(json.dumps(out, default=_jsonable))
    else:
        print(format_result(out))
    return 0


def _on_this_machine(args, d):
    if os.geteuid() != 0:
        raise PrivilegeError("testbed linktest builds namespaces and qdiscs: use sudo")
    if args.cc:
        os.environ[CC_ENV] = args.cc     # the probe's TCP sender uses it
    with routed_pair({"kv": d, "request": d}, backend=args.shaping) as link:
        # judged as the run's probe is: measured again once when it warns in a slow spell
        result = quiet_probe(link.wan, lambda: measure_link(
            link.src, link.dst, link.dst_ip, d.params(), duration_s=args.duration,
            calibrated=link.calibration is not None), tries=probe_tries(d))
        backend, reason = link.wan.backend, link.wan.backend_reason
        if d.police:
            result["measured"]["police_drops"] = link.wan.police_drops().get("kv", 0)
        if (link.calibration or {}).get("spell"):
            result["warnings"].append(link.calibration["spell"])
    cc = args.cc or open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    return {"backend": backend, "backend_reason": reason, "congestion_control": cc,
            "calibration": link.calibration, **result}


def _on_ray(args, d):
    """Between a dc=prfaas and a dc=local host of the Ray cluster, shaped by their agents (which
    need the Ray nodes to run as root; this process does not)."""
    out = linktest(args.address, d, shaping=args.shaping, duration_s=args.duration,
                   congestion_control=args.cc)
    return {"congestion_control": args.cc or "the prfaas host's default", **out}


def _jsonable(x):
    return float(x) if isinstance(x, (int, float)) else str(x)


def _path_rows(c, m, e):
    """The path MTU and policer rows, when configured."""
    rows = []
    if e.get("mtu"):
        rows.append(("path MTU (DF probe)", f"{e['mtu']} B", f"{m.get('mtu')} B", ""))
        rows.append(("PMTU learned (ICMP)", f"{e['mtu']} B" if e["mtu_icmp"] else "none",
                     f"{m.get('learned_mtu')} B", "1500 = no ICMP came"))
    if e.get("police_bps"):
        g = m["goodput_bps"]
        rows.append(("policer", units.fmt_rate(e["police_bps"]) + f", {c['police_burst']} B",
                     f"{m.get('police_drops', '-')} drops",
                     "" if g is None else f"goodput {g / e['police_bps']:.3f} of its rate"))
    return rows


def format_result(out):
    c, m, e = out["configured"], out["measured"], out["configured"]["expected"]
    g = m["goodput_bps"]
    rows = [("goodput (TCP payload)", units.fmt_rate(c["rate"]) + " link",
             "-" if g is None else units.fmt_rate(g),
             "not measured: PMTU blackhole" if g is None else f"{g / c['rate']:.3f} of rate"),
            ("RTT p50", f"{e['rtt_ms']:.2f} ms", f"{m['rtt_p50_ms']:.2f} ms", ""),
            ("RTT p99", "", f"{m['rtt_p99_ms']:.2f} ms", ""),
            ("jitter (one-way sd)", f"{e['jitter_ms']:.2f} ms", f"{m['jitter_ms']:.2f} ms", ""),
            ("loss", f"{e['loss']:.3%}",
             "-" if m["loss"] is None else f"{m['loss']:.3%}",
             f"{m['loss_packets']} packets" if m["loss"] is not None else ""),
            ("loss burst (packets)", "-" if not e.get("loss_burst") else f"{e['loss_burst']:g}",
             "-" if not m.get("loss_burst") else f"{m['loss_burst']:.2f}", "mean run"),
            ("reordered", "0", str(m["reordered"]), "")]
    for k, what in (("corrupt", "corrupted (receiver checksum)"), ("duplicate", "duplicated"),
                    ("reorder_share", "sent ahead (reorder)")):
        if e.get(k):
            rows.append((what, f"{e[k]:.3%}", "-" if m.get(k) is None else f"{m[k]:.3%}",
                         f"{m['loss_packets']} packets"))
    rows += _path_rows(c, m, e)
    lines = [f"backend: {out['backend']} ({out['backend_reason']}); TCP "
             f"{out['congestion_control']}"]
    if "hosts" in out:
        h = out["hosts"]
        lines.append(f"ray hosts: {h['src']} (dc=prfaas) -> {h['dst']} (dc=local, {h['dst_ip']});"
                     " shaped on " + ", ".join(f"{a['node']} {a['iface']}"
                                                for a in out["agents"].values()))
    cal = out.get("calibration")
    if cal:
        lines.append("calibration: fixed cost subtracted " + ", ".join(
            f"{d} {ms:.3f} ms" for d, ms in cal["fixed_cost_ms"].items()) + " a hop (idle RTT, "
            "each round: " + " -> ".join(f"{r:.3f}" for r in cal["rtt_ms"]) + " ms)")
    lines.append(f"{'':22} {'configured':>16} {'measured':>16}")
    lines += [f"{a:22} {b:>16} {c_:>16}  {d}" for a, b, c_, d in rows]
    lines.append(f"goodput: {m['goodput_basis']}")
    lines += [f"warning: {w}" for w in out["warnings"]]
    return "\n".join(lines)
