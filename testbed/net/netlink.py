"""Netlink through pyroute2: the one place a kernel's refusal becomes a `NetworkError`.

Every module that makes kernel objects (the WAN shaper `wan.py`, the namespace pairs
`pair.py`, `testbed doctor`) sends its requests through `call`, so a refusal is raised the same
way everywhere: a `NetworkError` naming what was asked and carrying the errno
(`NetworkError.errno`, pyroute2's `NetlinkError.code`), never pyroute2's own exception.
pyroute2 is imported when first used: `import testbed.net.netlink` costs nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_mod
import os

from testbed.errors import NetworkError


def call(what: str, fn, *args, **kwargs):
    """Run one pyroute2 request; a NetlinkError becomes a NetworkError naming `what` and the
    errno."""
    from pyroute2.netlink.exceptions import NetlinkError  # reason: pyroute2, heavy
    try:
        return fn(*args, **kwargs)
    except NetlinkError as e:
        raise NetworkError(f"{what}: {os.strerror(e.code)}", errno=e.code) from None


def open_netns(path: str):
    """A pyroute2 `NetNS` on the namespace file `path`; NetworkError (ENOENT) when it is gone."""
    from pyroute2 import NetNS  # reason: pyroute2, heavy
    if not os.path.exists(path):
        raise NetworkError(f"network namespace {path} does not exist", errno=errno_mod.ENOENT)
    return NetNS(path)


CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
_LIBC = None


def setns_fd(fd: int, what: str, nstype: int = CLONE_NEWNET) -> None:
    """setns(2) on the namespace open at `fd` (the calling thread only, for a network
    namespace); NetworkError naming `what` when the kernel refuses."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    if _LIBC.setns(fd, nstype) != 0:
        code = ctypes.get_errno()
        raise NetworkError(f"setns to {what}: {os.strerror(code)}", errno=code)


def enter_ns(path: str, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread (the process, for a mount namespace) into the namespace file
    `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_fd(fd, path, nstype)
    finally:
        os.close(fd)


@contextlib.contextmanager
def entered(path: str):
    """The calling thread inside the network namespace file `path` for the `with` block, then
    back where it was. NetworkError (ENOENT) when `path` is gone."""
    if not os.path.exists(path):
        raise NetworkError(f"network namespace {path} does not exist", errno=errno_mod.ENOENT)
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_ns(path)
        try:
            yield
        finally:
            setns_fd(back, "the namespace this thread came from")
    finally:
        os.close(back)


def open_netns_here(path: str):
    """A pyroute2 `IPRoute` on the namespace file `path` whose socket is made by this thread:
    it enters the namespace (setns, which moves the calling thread only), opens the socket and
    comes back. `open_netns` (pyroute2's `NetNS`) forks a child to make the socket instead:
    ~24 ms of CPU per open from an orchestrator of 350 MB (parent and child), against a few here
    (benchmark on a scratch namespace). Only for a socket used by the thread that opened it:
    another thread's calls would make their socket where that thread is (pyroute2 keeps one
    per thread). NetworkError (ENOENT) when `path` is gone."""
    from pyroute2 import IPRoute  # reason: pyroute2, heavy
    with entered(path):
        return IPRoute()


def sysctl_here(path: str, *settings: str) -> None:
    """Set network sysctls ('net.ipv4.tcp_comp_sack_delay_ns=100000') in the namespace file
    `path` from this thread: /proc/sys/net resolves in the opening thread's namespace, so the
    thread enters it, writes the files and comes back; `testbed.net.ns.sysctl` runs `nsenter
    sysctl` instead, two execs. NetworkError naming the setting."""
    with entered(path):
        for setting in settings:
            name, _, value = setting.partition("=")
            try:
                with open("/proc/sys/" + name.strip().replace(".", "/"), "w") as f:
                    f.write(value.strip() + "\n")
            except OSError as e:
                raise NetworkError(f"sysctl {setting} in {path}: {e.strerror}",
                                   errno=e.errno) from None


def register_fifo_plugins() -> None:
    """pyroute2 0.9.7 knows 'pfifo' but not 'bfifo'; for an unknown kind it silently sets the
    parent to root (so a 'bfifo' child replaced the root qdisc). Both use struct tc_fifo_qopt."""
    from pyroute2.netlink.rtnl.tcmsg import plugins, sched_pfifo  # reason: pyroute2, heavy
    plugins.setdefault("bfifo", sched_pfifo)


def keep_thread_loop(ns) -> None:
    """Keep the calling thread's event loop and transport on `ns` (a pyroute2 `NetNS`) between
    sync calls. pyroute2 0.9.7 keeps them only in the thread that opened `ns` (its thread-local
    `keep_event_loop`); in any other thread each sync call makes a new event loop and transport
    and closes them again (~0.3-0.4 ms of CPU a call, measured on a scratch namespace). For a
    thread that reads often (the 20 Hz counter read, `testbed.measure.CounterSampler`); what it
    keeps is closed with `ns` (`ns.close()`)."""
    ns.asyncore.local.keep_event_loop = True
