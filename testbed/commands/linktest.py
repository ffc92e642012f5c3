"""`testbed linktest`: build one shaped WAN link alone and print configured vs measured.

The link is the run's WAN in miniature, built by the same `testbed.net.shaping.Wan`:

    tb<id>s (PrfaaS side) --veth-- tb<id>r (router, shaping both egresses) --veth-- tb<id>d (local)

`src -> dst` is the `kv` direction (egress toward the local side), `dst -> src` the `request`
direction. `two_host_link` is the builder; the root tests and `benchmarks/link_fidelity.py` use it
too. Everything is recorded in a `Registry` and removed in `finally`, also on Ctrl-C.
"""

import contextlib
import dataclasses
import json
import os
import secrets

from testbed import kvwire, lifecycle, units
from testbed.errors import ConfigError, NetworkError, PrivilegeError
from testbed.net import shaping
from testbed.net.probe import measure_link

SUBNETS = ("10.201.1", "10.201.2")   # src side, dst side; private to the namespaces made here


@dataclasses.dataclass
class Link:
    """A built two-host link: namespace paths, the destination's address, the Wan on it."""

    src: str
    dst: str
    router: str
    dst_ip: str
    src_ip: str
    wan: shaping.Wan
    names: tuple


def _add_veth(ipr, a, b):
    shaping._netlink_call(f"adding veth {a}/{b}", ipr.link, "add", ifname=a, kind="veth", peer=b)


def _move(ipr, ifname, ns_name):
    idx = ipr.link_lookup(ifname=ifname)[0]
    shaping._netlink_call(f"moving {ifname} to {ns_name}", ipr.link, "set", index=idx,
                          net_ns_fd=ns_name)


def _address(ns_path, ifname, ip, gateway=None):
    from pyroute2 import NetNS
    with NetNS(ns_path) as ns:
        for name in ("lo", ifname):
            idx = ns.link_lookup(ifname=name)[0]
            ns.link("set", index=idx, state="up")
        idx = ns.link_lookup(ifname=ifname)[0]
        shaping._netlink_call(f"address {ip} on {ifname}", ns.addr, "add", index=idx,
                              address=ip, prefixlen=24)
        if gateway:
            shaping._netlink_call(f"default route via {gateway}", ns.route, "add",
                                  dst="0.0.0.0/0", gateway=gateway)


@contextlib.contextmanager
def two_host_link(params, backend="userspace", registry=None, seed=0):
    """Build src - router - dst namespaces with `Wan(params)` on the router; yield a `Link`.

    params: {"kv": {...}, "request": {...}} emulated-direction dicts. Removes everything on exit.
    """
    from pyroute2 import IPRoute, netns
    tag = secrets.token_hex(2)
    own = registry is None
    reg = registry or lifecycle.Registry(f"linktest-{tag}", kind="linktest")
    names = tuple(f"tb{tag}{x}" for x in "srd")
    src, router, dst = names
    try:
        for n in names:
            netns.create(n)
            reg.add_netns(n)
        with IPRoute() as ipr:
            # veth ends: <ns>0 in src/dst, <router>a (toward src), <router>b (toward dst)
            _add_veth(ipr, f"{src}0", f"{router}a")
            _add_veth(ipr, f"{dst}0", f"{router}b")
            for ifname, ns_name in ((f"{src}0", src), (f"{router}a", router),
                                    (f"{dst}0", dst), (f"{router}b", router)):
                _move(ipr, ifname, ns_name)
        path = {n: f"/var/run/netns/{n}" for n in names}
        s_net, d_net = SUBNETS
        _address(path[src], f"{src}0", f"{s_net}.2", f"{s_net}.1")
        _address(path[dst], f"{dst}0", f"{d_net}.2", f"{d_net}.1")
        _address(path[router], f"{router}a", f"{s_net}.1")
        _address(path[router], f"{router}b", f"{d_net}.1")
        _sysctl(path[router], "net.ipv4.ip_forward=1")
        for end in (src, dst):
            # TCP buffers beyond the default 6 MB: 1 Gbit/s x 40 ms is 5 MB in flight, and the
            # default caps the window below that (measured 0.80-0.86 of the rate at 1G, 20 ms)
            _sysctl(path[end], "net.ipv4.tcp_rmem=4096 131072 67108864",
                    "net.ipv4.tcp_wmem=4096 16384 67108864")
        if shaping.needs_per_frame_packets(params):
            for end in (src, dst):
                shaping.disable_offloads(path[end], f"{end}0")
        wan = shaping.Wan(path[router], {"kv": f"{router}b", "request": f"{router}a"}, params,
                          backend=backend, seed=seed, registry=reg)
        wan.start()
        yield Link(src=path[src], dst=path[dst], router=path[router], dst_ip=f"{d_net}.2",
                   src_ip=f"{s_net}.2", wan=wan, names=names)
    finally:
        if own:
            reg.close()


def _sysctl(ns_path, *settings):
    """Set per-namespace sysctls (ip_forward, tcp_rmem/wmem) inside `ns_path` only."""
    import subprocess
    r = subprocess.run(["nsenter", f"--net={ns_path}", "sysctl", "-qw", *settings],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise NetworkError(f"sysctl {' '.join(settings)} in {ns_path}: {r.stderr.strip()}")


def direction_params(rate, delay, jitter, loss, queue, jitter_dist="normal", loss_burst=None):
    """One symmetric direction dict from command-line strings (units as in the YAML)."""
    from testbed.net.spec import _queue
    try:
        q = None if queue is None else _queue(queue)
    except ValueError as e:
        raise ConfigError(str(e), key="--queue") from None
    return shaping.check_params({"rate": rate, "delay": delay, "jitter": jitter, "loss": loss,
                                 "queue": q, "jitter_dist": jitter_dist,
                                 "loss_burst": loss_burst}, "linktest")


def register(sub):
    p = sub.add_parser("linktest", help="build one shaped link alone, print configured vs measured"
                                        " (root)")
    p.add_argument("--rate", default="100Mbit", help="link rate (default 100Mbit)")
    p.add_argument("--delay", default="5ms", help="one-way delay (default 5ms)")
    p.add_argument("--jitter", default="0ms", help="one-way delay std dev (default 0)")
    p.add_argument("--loss", default="0", help="random loss, e.g. 1%% (default 0)")
    p.add_argument("--loss-burst", default=None,
                   help="mean loss burst in packets (Gilbert model; default: independent)")
    p.add_argument("--queue", default=None, help="drop-tail queue, bytes or '100p' (default BDP)")
    p.add_argument("--backend", default="auto", choices=("auto", "netem", "userspace"))
    p.add_argument("--duration", type=float, default=2.0, help="seconds of bulk TCP (default 2)")
    p.add_argument("--cc", default=None, choices=("cubic", "bbr", "reno"),
                   help="TCP congestion control of the two hosts (default: the machine's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def main(args):
    if os.geteuid() != 0:
        raise PrivilegeError("testbed linktest builds namespaces and qdiscs: use sudo")
    d = direction_params(args.rate, args.delay, args.jitter, args.loss, args.queue,
                         loss_burst=args.loss_burst)
    if args.cc:
        os.environ[kvwire.CC_ENV] = args.cc     # the probe's TCP sender uses it
    with two_host_link({"kv": d, "request": d}, backend=args.backend) as link:
        result = measure_link(link.src, link.dst, link.dst_ip, d, duration_s=args.duration)
        backend, reason = link.wan.backend, link.wan.backend_reason
    cc = args.cc or open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    out = {"backend": backend, "backend_reason": reason, "congestion_control": cc, **result}
    if args.json:
        print(json.dumps(out, default=_jsonable))
    else:
        print(format_result(out))
    return 0


def _jsonable(x):
    return float(x) if isinstance(x, (int, float)) else str(x)


def format_result(out):
    c, m, e = out["configured"], out["measured"], out["configured"]["expected"]
    rows = [("goodput (TCP payload)", units.fmt_rate(c["rate"]) + " link",
             units.fmt_rate(m["goodput_bps"]), f"{m['goodput_bps'] / c['rate']:.3f} of rate"),
            ("RTT p50", f"{e['rtt_ms']:.2f} ms", f"{m['rtt_p50_ms']:.2f} ms", ""),
            ("RTT p99", "", f"{m['rtt_p99_ms']:.2f} ms", ""),
            ("jitter (one-way sd)", f"{e['jitter_ms']:.2f} ms", f"{m['jitter_ms']:.2f} ms", ""),
            ("loss", f"{e['loss']:.3%}",
             "-" if m["loss"] is None else f"{m['loss']:.3%}",
             f"{m['loss_packets']} packets" if m["loss"] is not None else ""),
            ("loss burst (packets)", "-" if not e.get("loss_burst") else f"{e['loss_burst']:g}",
             "-" if not m.get("loss_burst") else f"{m['loss_burst']:.2f}", "mean run"),
            ("reordered", "0", str(m["reordered"]), "")]
    lines = [f"backend: {out['backend']} ({out['backend_reason']}); TCP "
             f"{out['congestion_control']}",
             f"{'':22} {'configured':>16} {'measured':>16}"]
    lines += [f"{a:22} {b:>16} {c_:>16}  {d}" for a, b, c_, d in rows]
    lines.append(f"goodput: {m['goodput_basis']}")
    lines += [f"warning: {w}" for w in out["warnings"]]
    return "\n".join(lines)
