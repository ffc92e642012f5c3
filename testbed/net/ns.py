"""Running a command inside a network namespace: the one way the testbed does it.

A namespace is named by its file: a name under /var/run/netns (what `ip netns add` and pyroute2's
`netns.create` make) or a path such as /proc/PID/ns/net (a Mininet host's). Commands enter it
with `nsenter --net=PATH`, which changes the network namespace only (unlike `ip netns exec`, it
does not remount /sys), so a process keeps its view of the files and the PIDs it knows.
Light on purpose (subprocess, and netlink's setns for sysctls): every namespace host and link
builder imports it.
"""

from __future__ import annotations

import subprocess

from testbed.errors import NetworkError
from testbed.net import netlink

NETNS_DIR = "/var/run/netns"


def ns_path(ns: str) -> str:
    """The namespace file of `ns`: a path as is, a name under /var/run/netns."""
    return ns if "/" in ns else f"{NETNS_DIR}/{ns}"


def ns_argv(ns: str | None, argv) -> list[str]:
    """`argv` run inside network namespace `ns` (None: in this one)."""
    argv = [str(a) for a in argv]
    return argv if ns is None else ["nsenter", f"--net={ns_path(ns)}", *argv]


def ns_run(ns: str | None, argv, **kw) -> subprocess.CompletedProcess:
    """subprocess.run of `argv` inside `ns`."""
    return subprocess.run(ns_argv(ns, argv), **kw)


def ns_popen(ns: str | None, argv, **kw) -> subprocess.Popen:
    """subprocess.Popen of `argv` inside `ns`."""
    return subprocess.Popen(ns_argv(ns, argv), **kw)


def sysctl(ns: str, *settings: str) -> None:
    """Set sysctls (`net.ipv4.ip_forward=1`, ...) inside `ns` only: written from this thread
    inside it (`netlink.sysctl_here`, 0.15 ms a host against 4.3-4.7 for `nsenter sysctl`)."""
    netlink.sysctl_here(ns_path(ns), *settings)


def disable_offloads(ns: str, ifname: str) -> None:
    """`ethtool -K ifname tso off gso off` inside `ns`: the host sends single frames, so loss
    hits frames, not 64 KiB bursts (`testbed.net.linkmodel.needs_per_frame_packets`)."""
    r = ns_run(ns, ["ethtool", "-K", ifname, "tso", "off", "gso", "off"], capture_output=True,
               text=True)
    if r.returncode != 0:
        raise NetworkError(f"turning segmentation offload off on {ifname}: "
                           f"{r.stderr.strip() or r.returncode}")


def disable_checksum_offload(ns: str, ifname: str) -> None:
    """`ethtool -K ifname tx off rx off` inside `ns`: the host computes its checksums (tx) and
    checks what it receives (rx), so a packet the link corrupted is dropped (over veth both
    are skipped with offload on: a corrupted packet would be taken as good)."""
    r = ns_run(ns, ["ethtool", "-K", ifname, "tx", "off", "rx", "off"], capture_output=True,
               text=True)
    if r.returncode != 0:
        raise NetworkError(f"turning checksum offload off on {ifname}: "
                           f"{r.stderr.strip() or r.returncode}")
