"""Namespace pairs: a link between network namespaces, without a whole testbed.

The run's own network is Mininet hosts and bridges (`testbed/net/build.py`). The commands and
benchmarks that need only a link build it here, the one place that does:

- `veth_pair()`: two namespaces joined by one veth (`testbed selfcheck`, the KV transfer
  benchmark): a plain, unshaped path that still crosses the kernel's network stack.
- `routed_pair(params)`: the run's WAN in miniature, `src -- router -- dst`, with the same
  `testbed.net.wan.Wan` on the router's two egresses (`testbed linktest`, the link
  fidelity benchmark, the link root tests). `src -> dst` is the `kv` direction.

Every namespace is recorded in a `testbed.lifecycle.Registry` before it is created and removed
in reverse order on exit (also on Ctrl-C; `testbed clean` if the process dies first). Kernel
objects are made through pyroute2; a failed request raises `NetworkError` with its errno.

Commands inside these namespaces run through `testbed.net.ns`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets

from testbed import lifecycle
from testbed.net.calibrate import calibrate as calibrate_link
from testbed.net.linkmodel import needs_checksums, needs_per_frame_packets
from testbed.net.netlink import call as _netlink
from testbed.net.ns import disable_checksum_offload, disable_offloads, ns_path, sysctl
from testbed.net.wan import Wan

VETH_ADDRESSES = ("10.254.77.1", "10.254.77.2")     # veth_pair's two ends
ROUTED_SUBNETS = ("10.201.1", "10.201.2")           # routed_pair's src side, dst side
PREFIXLEN = 24


# ---------------------------------------------------------------- kernel objects

def create_netns(reg: lifecycle.Registry, name: str) -> str:
    """A named namespace, on record before it exists; returns its path."""
    from pyroute2 import netns  # reason: pyroute2, heavy

    reg.add_netns(name)
    _netlink(f"creating netns {name}", netns.create, name)
    return ns_path(name)


def add_veth(a: str, ns_a: str, b: str, ns_b: str) -> None:
    """A veth pair a/b with end `a` moved into namespace `ns_a` and `b` into `ns_b` (names)."""
    from pyroute2 import IPRoute  # reason: pyroute2, heavy

    with IPRoute() as ipr:
        _netlink(f"adding veth {a}/{b}", ipr.link, "add", ifname=a, kind="veth", peer=b)
        for ifname, ns in ((a, ns_a), (b, ns_b)):
            idx = ipr.link_lookup(ifname=ifname)[0]
            _netlink(f"moving {ifname} into {ns}", ipr.link, "set", index=idx, net_ns_fd=ns)


def address(ns: str, ifname: str, ip: str, prefixlen: int = PREFIXLEN,
            gateway: str | None = None) -> None:
    """Bring `lo` and `ifname` up in `ns`, give `ifname` the address, and a default route via
    `gateway` if given."""
    from pyroute2 import NetNS  # reason: pyroute2, heavy

    with NetNS(ns_path(ns)) as n:
        for name in ("lo", ifname):
            idx = n.link_lookup(ifname=name)[0]
            _netlink(f"bringing {name} up in {ns}", n.link, "set", index=idx, state="up")
        idx = n.link_lookup(ifname=ifname)[0]
        _netlink(f"address {ip} on {ifname} in {ns}", n.addr, "add", index=idx, address=ip,
                 prefixlen=prefixlen)
        if gateway:
            _netlink(f"default route via {gateway} in {ns}", n.route, "add",
                     dst="0.0.0.0/0", gateway=gateway)


def rx_bytes(ns: str, ifname: str) -> int:
    """The kernel's count of bytes received on `ifname` inside `ns`."""
    from pyroute2 import NetNS  # reason: pyroute2, heavy

    with NetNS(ns_path(ns)) as n:
        link = n.get_links(n.link_lookup(ifname=ifname)[0])[0]
        return link.get_attr("IFLA_STATS64")["rx_bytes"]


@contextlib.contextmanager
def _registry(registry, kind):
    """The caller's registry, or one of our own closed on exit (everything removed)."""
    if registry is not None:
        yield registry
        return
    reg = lifecycle.Registry(secrets.token_hex(4), kind=kind)
    try:
        yield reg
    finally:
        reg.close()


# ---------------------------------------------------------------- two namespaces, one veth

@dataclasses.dataclass(frozen=True)
class VethPair:
    """Namespaces `a` and `b` (names) joined by a veth whose ends are `if_a` / `if_b`."""

    a: str
    b: str
    if_a: str
    if_b: str
    ip_a: str
    ip_b: str


@contextlib.contextmanager
def veth_pair(registry: lifecycle.Registry | None = None, names=("a", "b"),
              addresses=VETH_ADDRESSES):
    """Namespaces <prefix>-<names[0]> and <prefix>-<names[1]> joined by a veth, addressed;
    yields a `VethPair`. With no `registry`, one is made and closed on exit."""
    with _registry(registry, "veth-pair") as reg:
        ns = [f"{reg.prefix}-{n}" for n in names]
        ifs = [f"{reg.prefix}{n[0]}" for n in names]
        for n in ns:
            create_netns(reg, n)
        reg.add_link(ifs[0])        # in the root namespace until moved
        add_veth(ifs[0], ns[0], ifs[1], ns[1])
        for n, ifname, ip in zip(ns, ifs, addresses):
            address(n, ifname, ip)
        yield VethPair(a=ns[0], b=ns[1], if_a=ifs[0], if_b=ifs[1], ip_a=addresses[0],
                       ip_b=addresses[1])


# ---------------------------------------------------------------- src -- router -- dst

@dataclasses.dataclass
class RoutedPair:
    """A built src - router - dst link: namespace paths, addresses, the Wan on the router."""

    src: str
    dst: str
    router: str
    dst_ip: str
    src_ip: str
    wan: Wan
    names: tuple
    calibration: dict | None = None     # testbed.net.calibrate: the fixed cost subtracted


@contextlib.contextmanager
def routed_pair(params, backend="userspace", registry=None, seed=0, calibrate=True):
    """Build src - router - dst namespaces with `Wan(params)` on the router; yield a
    `RoutedPair`. params: {"kv": Link, "request": Link}, emulated and checked
    (`testbed.net.linkmodel.check_params`). `calibrate`: measure the path's fixed cost and
    subtract it from the delay lines' delays (`testbed.net.calibrate`).

    With no `registry`, one is made and closed on exit (everything removed)."""
    with _registry(registry, "linktest") as reg:
        tag = secrets.token_hex(2)      # several links may share the caller's registry
        names = tuple(f"tb{tag}{x}" for x in "srd")
        src, router, dst = names
        path = {n: create_netns(reg, n) for n in names}
        # veth ends: <ns>0 in src/dst, <router>a (toward src), <router>b (toward dst)
        add_veth(f"{src}0", src, f"{router}a", router)
        add_veth(f"{dst}0", dst, f"{router}b", router)
        s_net, d_net = ROUTED_SUBNETS
        address(src, f"{src}0", f"{s_net}.2", gateway=f"{s_net}.1")
        address(dst, f"{dst}0", f"{d_net}.2", gateway=f"{d_net}.1")
        address(router, f"{router}a", f"{s_net}.1")
        address(router, f"{router}b", f"{d_net}.1")
        sysctl(router, "net.ipv4.ip_forward=1")
        for end in (src, dst):
            # TCP buffers beyond the default 6 MB: 1 Gbit/s x 40 ms is 5 MB in flight, and the
            # default caps the window below that (measured 0.80-0.86 of the rate at 1G, 20 ms)
            sysctl(end, "net.ipv4.tcp_rmem=4096 131072 67108864",
                   "net.ipv4.tcp_wmem=4096 16384 67108864")
        if needs_per_frame_packets(params):
            for end in (src, dst):
                disable_offloads(path[end], f"{end}0")
        if needs_checksums(params):
            for end in (src, dst):
                disable_checksum_offload(path[end], f"{end}0")
        wan = Wan(path[router], {"kv": f"{router}b", "request": f"{router}a"}, params,
                  backend=backend, seed=seed, registry=reg)
        wan.start()
        cal = calibrate_link(wan, path[src], path[dst], f"{d_net}.2") if calibrate else None
        yield RoutedPair(src=path[src], dst=path[dst], router=path[router], dst_ip=f"{d_net}.2",
                         src_ip=f"{s_net}.2", wan=wan, names=names, calibration=cal)
