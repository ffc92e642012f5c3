"""`testbed doctor`: what this machine offers the link emulation, and which backend `auto` picks.

Each check creates nothing outside scratch namespaces (`tbdoc<pid>`, always removed): qdisc kinds
are tried on `lo` of a scratch namespace, NFQUEUE by binding the delay line's queue there. The
namespace and the delay line are on record (a state file, `testbed.lifecycle.scratch_netns`) while
they exist, so a killed doctor leaves nothing that `testbed clean` cannot remove.
"""

import contextlib
import errno
import importlib
import os
import shutil
import subprocess

from testbed import lifecycle
from testbed.errors import NetworkError
from testbed.net import netlink
from testbed.net.delayline import delayline_binary
from testbed.net.ns import ns_popen
from testbed.net.wan import probe_backend

QDISCS = ("htb", "tbf", "bfifo", "pfifo", "netem", "fq", "fq_codel", "red", "hfsc")


def register(sub):
    p = sub.add_parser("doctor", help="list kernel features and the shaping backend auto picks")
    p.set_defaults(func=main)


def _qdisc_available(ns, idx, kind):
    netlink.register_fifo_plugins()
    extra = {"tbf": {"rate": "1mbit", "burst": 10000, "limit": 10000}}.get(
        kind, {"limit": 1000} if "fifo" in kind else {})
    try:
        netlink.call(f"qdisc {kind}", ns.tc, "add", kind, index=idx, handle=0x10000, **extra)
    except NetworkError as e:
        if e.errno == errno.ENOENT:
            return False, "not in this kernel (ENOENT)"
        return False, os.strerror(e.errno)
    except Exception as e:   # pyroute2 could not encode the request: not a kernel answer
        return False, f"not tried ({e})"
    with contextlib.suppress(Exception):
        ns.tc("del", index=idx, handle=0x10000, parent=0xFFFFFFFF)
    return True, ""


def _nfqueue_available(ns_path, registry):
    try:
        binary = delayline_binary()
    except Exception as e:
        return False, str(e)
    p = ns_popen(ns_path, [binary, "7", "16", "0", "0", "normal", "0", "0", "1", "0", "1", "1"],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 preexec_fn=lifecycle.die_with_parent())
    registry.add_process(p.pid, "tb-delayline (doctor's NFQUEUE check)")
    try:
        out, err = p.communicate("", timeout=5)   # empty stdin: binds, says ready, exits
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return False, "delay line did not answer within 5 s"
    return ("ready" in out), (err.strip() or "")


def main(args):
    rows = []
    root = os.geteuid() == 0
    rows.append(("root", root, "" if root else "namespaces and tc need sudo"))
    try:
        importlib.import_module("mininet.net")
        rows.append(("mininet importable", True, ""))
    except Exception as e:
        rows.append(("mininet importable", False, str(e)))
    for tool in ("nsenter", "iptables", "iptables-restore", "nft", "gcc", "iperf3"):
        rows.append((f"{tool} on PATH", bool(shutil.which(tool)), ""))
    try:
        importlib.import_module("netfilterqueue")
        rows.append(("NetfilterQueue (python)", True, "installed; the delay line uses C instead"))
    except Exception as e:
        rows.append(("NetfilterQueue (python)", False, str(e)))
    if root:
        rows += _kernel_rows()
        backend, reason = probe_backend()
    else:
        backend, reason = "userspace", "not root: could not probe the kernel"
    width = max(len(r[0]) for r in rows)
    for name, ok, note in rows:
        print(f"{name:{width}}  {'yes' if ok else 'NO ':3}  {note}".rstrip())
    print(f"\nbackend auto picks: {backend}  ({reason})")
    return 0


def _kernel_rows():
    from pyroute2 import NetNS      # root only: doctor lists what is missing, it needs none

    name = f"tbdoc{os.getpid()}"
    rows = []
    with lifecycle.scratch_netns(name, kind="doctor") as registry:
        path = f"/var/run/netns/{name}"
        with NetNS(path) as ns:
            lo = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=lo, state="up")
            for kind in QDISCS:
                ok, why = _qdisc_available(ns, lo, kind)
                rows.append((f"qdisc {kind}", ok, why))
        ok, why = _nfqueue_available(path, registry)
        rows.append(("NFQUEUE (tb-delayline binds)", ok, why))
    return rows
