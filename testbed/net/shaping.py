"""The WAN link model, installed on the WAN router's two egress interfaces.

Place in the architecture: the builder (Mininet spine, or `testbed linktest`) creates a router
namespace with one interface toward each datacenter and hands its namespace path to `Wan`. The
router forwards between them; everything that crosses the WAN leaves through one of two egress
interfaces, so shaping there makes a real bottleneck whose queue fills and drops, instead of
back-pressuring the sender's socket.

    kv       PrfaaS -> local, leaves through ifaces["kv"]       (toward the local PD cluster)
    request  local -> PrfaaS, leaves through ifaces["request"]  (toward the PrfaaS cluster)

Per direction the model is: random loss (independent, or in bursts from a Gilbert chain when
`loss_burst` is set), then a delay line (delay + jitter, FIFO unless
`reorder`), then the bottleneck: an HTB class at `rate` whose child is a drop-tail queue of
`queue` bytes or packets (default one bandwidth-delay product). Two backends build it:

- `netem`: HTB class + netem child (delay, jitter, loss, limit); everything over netlink.
- `userspace` (kernels without netem, such as these machines): HTB class + bfifo/pfifo child;
  loss by an iptables `statistic` rule in the router namespace; delay, jitter and burst loss by
  `tb-delayline` (delayline.c), a C program holding NFQUEUE verdicts on a microsecond timer. It
  runs as a supervised child per direction, registered with the run's `Registry`, and exits on
  its own when this process goes away (its control pipe closes).

`auto` picks netem when a scratch namespace accepts an HTB + netem pair (`probe_backend`). HTB's
burst is computed from the rate (`htb_burst_bytes`): pyroute2's default (rate/HZ + MTU) is far too
small above 1 Gbit/s. `Wan.set` changes a live link (one netlink request, or one write to the
delay line, or one iptables-restore) and logs the change; runs replay rate traces and scheduled changes through it
(`testbed.net.schedule.LinkSchedule`, fed by `config.read_rate_trace`).
"""

import contextlib
import errno as errno_mod
import functools
import hashlib
import math
import os
import pathlib
import select
import shutil
import stat
import subprocess
import tempfile
import threading
import time

from testbed import lifecycle, units
from testbed.errors import ConfigError, NetworkError

DIRECTIONS = ("kv", "request")
FRAME_BYTES = 1514          # Ethernet frame of a full-MTU packet, what the qdiscs count
BURST_S = 0.001             # HTB burst = 1 ms of line rate (enough for the 10 Gbit/s ceiling here)
MIN_BURST_BYTES = 2 * FRAME_BYTES
# The default queue never drops below 96 KiB: senders with TSO hand the router 64 KiB GSO
# bursts at once (veth does not pace them), and a queue smaller than one burst drops all of it
# (measured: 12 KiB at 1 Gbit/s, 0 ms gave 0.3% of the rate; 96 KiB gave 95%).
MIN_QUEUE_BYTES = 96 * 1024
MAX_NFQUEUE_PACKETS = 65536
HTB_HANDLE, CLASS_HANDLE, LEAF_HANDLE = 0x10000, 0x10010, 0x100000   # 1:  1:10  10:
TC_H_ROOT = 0xFFFFFFFF
SETTABLE = ("rate", "delay", "jitter", "loss", "loss_burst", "up", "queue")
DELAYLINE_SRC = pathlib.Path(__file__).with_name("delayline.c")


# ---------------------------------------------------------------- pure link arithmetic (unit-tested)

def htb_burst_bytes(rate_bps):
    """HTB burst (= cburst) in bytes for `rate_bps`: 1 ms of line rate, at least two frames."""
    return int(max(rate_bps / 8 * BURST_S, MIN_BURST_BYTES))


def htb_quantum_bytes(rate_bps):
    """DRR quantum of the one HTB class: rate/r2q clamped to what HTB accepts without warning."""
    return int(min(max(rate_bps / 8 / 10, FRAME_BYTES), 200_000))


def default_queue_bytes(rate_bps, rtt_s):
    """One bandwidth-delay product (rate x round-trip propagation delay), at least 96 KiB."""
    return int(max(rate_bps / 8 * rtt_s, MIN_QUEUE_BYTES))


def queue_limit(queue, rate_bps, rtt_s):
    """('bfifo', bytes) or ('pfifo', packets) for a queue spec ({'bytes'|'packets': n} or None)."""
    if queue is None:
        return "bfifo", default_queue_bytes(rate_bps, rtt_s)
    if "packets" in queue:
        return "pfifo", int(queue["packets"])
    return "bfifo", int(queue["bytes"])


def queue_packets(queue, rate_bps, rtt_s):
    """The queue limit expressed in full-size packets (netem's `limit` and delay-line sizing)."""
    kind, n = queue_limit(queue, rate_bps, rtt_s)
    return n if kind == "pfifo" else max(1, math.ceil(n / FRAME_BYTES))


def delayline_capacity(p):
    """Packets the delay line may hold: 4x what the link carries during the longest delay.

    Arrivals run ahead of the link rate (slow start doubles, TSO bursts of 43 frames), so 2x was
    measured to overflow at 1 Gbit/s, 5 ms (375 kernel queue drops in 4 s); 4x did not."""
    longest_s = p["delay"] + 4 * p["jitter"]
    in_flight = p["rate"] / 8 * longest_s / FRAME_BYTES
    return int(min(max(4 * in_flight + 1024, 4096), MAX_NFQUEUE_PACKETS))


def gilbert(loss, burst):
    """(p_gb, p_bg) of a Gilbert chain (good state never drops, bad state always does) whose
    stationary loss is `loss` and whose loss bursts last `burst` packets on average.

    Bursts are geometric: each bad packet stays bad with 1 - p_bg, so the mean is 1 / p_bg; the
    bad state's share is p_gb / (p_gb + p_bg) = loss."""
    p_bg = 1.0 / burst
    return loss * p_bg / (1.0 - loss), p_bg


def burst_loss(p):
    """True when `p` asks for Gilbert burst loss (a loss_burst and a loss above 0)."""
    return p.get("loss_burst") is not None and p["loss"] > 0


def check_params(p, direction="wan"):
    """A validated copy of one direction's emulated parameters (see Experiment.emulated_direction).

    Raises ConfigError naming the key; fills `jitter_dist`, `reorder`, `up`, `queue` defaults.
    """
    out = {"delay": 0.0, "jitter": 0.0, "loss": 0.0, "queue": None, "up": True,
           "jitter_dist": "normal", "reorder": False, "loss_burst": None}
    out.update(p or {})
    key = f"network.wan.{direction}"
    if "rate" not in out or out["rate"] is None:
        raise ConfigError("expected a rate in bit/s", key=f"{key}.rate")
    for name, parse in (("rate", units.rate_bps), ("delay", units.duration_s),
                        ("jitter", units.duration_s), ("loss", units.probability)):
        try:
            out[name] = float(parse(out[name]))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), key=f"{key}.{name}") from None
    if out["rate"] < 8e3:
        raise ConfigError(f"expected a rate of at least 8 kbit/s, got {out['rate']:g}",
                          key=f"{key}.rate")
    if out["delay"] < 0 or out["jitter"] < 0:
        raise ConfigError("expected a delay and jitter of at least 0", key=key)
    q = out["queue"]
    if q is not None and not (isinstance(q, dict) and len(q) == 1
                              and next(iter(q)) in ("bytes", "packets")
                              and int(next(iter(q.values()))) >= 1):
        raise ConfigError(f"expected {{'bytes': N}} or {{'packets': N}}, got {q!r}",
                          key=f"{key}.queue")
    if out["jitter_dist"] not in ("normal", "pareto", "uniform"):
        raise ConfigError(f"expected normal, pareto or uniform, got {out['jitter_dist']!r}",
                          key=f"{key}.jitter_dist")
    out["up"] = bool(out["up"])
    out["reorder"] = bool(out["reorder"])
    if out["loss_burst"] is not None:
        try:
            out["loss_burst"] = float(units.number(out["loss_burst"]))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), key=f"{key}.loss_burst") from None
        if out["loss_burst"] < 1:
            raise ConfigError(f"expected a mean burst of at least 1 packet, got "
                              f"{out['loss_burst']:g}", key=f"{key}.loss_burst")
        if out["loss"] > 0 and (out["loss"] >= 1
                                or gilbert(out["loss"], out["loss_burst"])[0] > 1):
            raise ConfigError(f"loss {out['loss']:g} with bursts of {out['loss_burst']:g} "
                              f"packets needs a good->bad probability above 1; use longer bursts",
                              key=f"{key}.loss_burst")
    return out


def needs_per_frame_packets(params):
    """True when loss is configured in any direction: loss must hit single frames.

    Senders with TSO/GSO hand the router 64 KiB bursts that the loss rule (and the delay line)
    see as one packet; dropping a whole burst is one loss event for TCP where a real link drops
    single frames, so TCP under loss would look far better than it is. With loss configured the
    builders turn segmentation offload off on the end hosts (`disable_offloads`), at the price of
    per-frame work in the delay line (about 0.6 Gbit/s at most here instead of ~1).
    """
    return any(p.get("loss", 0) or p.get("loss_burst") for p in params.values())


def disable_offloads(ns_path, ifname):
    """`ethtool -K ifname tso off gso off` inside the namespace at `ns_path`."""
    r = subprocess.run(["nsenter", f"--net={ns_path}", "ethtool", "-K", ifname, "tso", "off",
                        "gso", "off"], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetworkError(f"turning segmentation offload off on {ifname}: "
                           f"{r.stderr.strip() or r.returncode}")


# ---------------------------------------------------------------- netlink helpers

def _register_fifo_plugins():
    """pyroute2 0.9.7 knows 'pfifo' but not 'bfifo'; for an unknown kind it silently sets the
    parent to root (so a 'bfifo' child replaced the root qdisc). Both use struct tc_fifo_qopt."""
    from pyroute2.netlink.rtnl.tcmsg import plugins, sched_pfifo
    plugins.setdefault("bfifo", sched_pfifo)


def _netlink_call(what, fn, *args, **kwargs):
    """Run one pyroute2 request; a NetlinkError becomes a NetworkError naming `what` and errno."""
    from pyroute2.netlink.exceptions import NetlinkError
    try:
        return fn(*args, **kwargs)
    except NetlinkError as e:
        raise NetworkError(f"{what}: {os.strerror(e.code)}", errno=e.code) from None


def _open_netns(path):
    from pyroute2 import NetNS
    if not os.path.exists(path):
        raise NetworkError(f"network namespace {path} does not exist", errno=errno_mod.ENOENT)
    return NetNS(path)


def _leaf_stats(msgs, handle):
    """TCA_STATS of the qdisc with `handle` among a qdisc dump, or None."""
    for m in msgs:
        if m["handle"] == handle:
            return m.get_attr("TCA_STATS")
    return None


# ---------------------------------------------------------------- backend probe

@functools.lru_cache(maxsize=1)
def probe_backend():
    """('netem'|'userspace', reason): try HTB + a netem child on `lo` of a scratch namespace.

    Cached per process; needs root. The scratch namespace is `tbprobe<pid>`, on record (state
    file) while it exists, so `testbed clean` removes it if this process is killed meanwhile.
    """
    name = f"tbprobe{os.getpid()}"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lifecycle.scratch_netns(name, kind="netem-probe"))
        except Exception as e:  # not root, or namespaces unavailable: no kernel answer to give
            return "userspace", f"could not create a scratch namespace to probe netem ({e})"
        return _probe_netem(name)


def _probe_netem(name):
    from pyroute2.netlink.exceptions import NetlinkError
    with _open_netns(f"/var/run/netns/{name}") as ns:
        lo = ns.link_lookup(ifname="lo")[0]
        ns.link("set", index=lo, state="up")
        try:
            ns.tc("add", "htb", index=lo, handle=HTB_HANDLE, default=0x10)
            ns.tc("add-class", "htb", index=lo, handle=CLASS_HANDLE, parent=HTB_HANDLE,
                  rate="1gbit", ceil="1gbit", burst=htb_burst_bytes(1e9),
                  cburst=htb_burst_bytes(1e9))
        except NetlinkError as e:
            return "userspace", f"htb qdisc not usable ({os.strerror(e.code)})"
        try:
            ns.tc("add", "netem", index=lo, handle=LEAF_HANDLE, parent=CLASS_HANDLE,
                  delay=1000, limit=1000)
        except NetlinkError as e:
            return "userspace", (f"netem qdisc missing from this kernel (errno {e.code} "
                                 f"{errno_mod.errorcode.get(e.code, '')} adding it); "
                                 "HTB + bfifo + NFQUEUE delay line instead")
        return "netem", "netem qdisc accepted as an HTB child in a scratch namespace"


# ---------------------------------------------------------------- the delay line process

# Compiler flags of tb-delayline: warnings shown, not fatal (a newer gcc may add some; the unit
# test builds with -Werror), and the usual hardening of a binary that runs as root.
DELAYLINE_CFLAGS = ("-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong",
                    "-fPIE", "-pie", "-Wl,-z,relro,-z,now")
DELAYLINE_LIBS = ("-lnetfilter_queue", "-lnfnetlink", "-lm")
ROOT_CACHE = pathlib.Path("/var/cache/prfaas-testbed")


def _check_private_dir(path, uid):
    """Raise NetworkError unless `path` and every directory above it are real directories owned
    by root or `uid` and writable by nobody else (so no one but them can swap the binary)."""
    for d in [path, *path.parents]:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise NetworkError(f"delay line cache: {d} is not a directory (a symlink?)")
        if st.st_uid not in (0, uid):
            raise NetworkError(f"delay line cache: {d} is owned by uid {st.st_uid}, expected "
                               f"root{'' if uid == 0 else f' or uid {uid}'}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise NetworkError(f"delay line cache: {d} is writable by group or others "
                               f"(mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it")


def _sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def delayline_binary(cache_dir=None):
    """Path of the compiled `tb-delayline`, built from delayline.c on first use, and checked
    before every use, because it runs as root.

    Root's copy lives in /var/cache/prfaas-testbed (0755, root-owned), never in the repository
    or a user's cache; other users use $XDG_CACHE_HOME/prfaas-testbed. The binary is named by
    the SHA-256 of the source and flags (a changed source compiles anew; versions coexist), and
    `<binary>.sha256` beside it records that source hash and the binary's own. Before it is
    returned: the directory chain passes `_check_private_dir`, the binary is a regular file owned
    by the caller (root), not writable by group or others, and the record matches both hashes
    (a mismatch, from a race of two builds or a torn write, rebuilds once); anything else is a
    NetworkError naming the path. gcc runs with a minimal environment.
    """
    uid = os.geteuid()
    if cache_dir is None:
        cache_dir = ROOT_CACHE if uid == 0 else pathlib.Path(
            os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "prfaas-testbed"
    cache_dir = pathlib.Path(cache_dir).absolute()
    src = DELAYLINE_SRC.read_bytes()
    tag = hashlib.sha256(src + "\0".join(DELAYLINE_CFLAGS + DELAYLINE_LIBS).encode()).hexdigest()
    out = cache_dir / f"tb-delayline-{tag[:16]}"
    record = out.with_name(out.name + ".sha256")
    if cache_dir.parent.exists():
        _check_private_dir(cache_dir.parent, uid)
    cache_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    _check_private_dir(cache_dir, uid)
    for attempt in range(2):
        if attempt or not (out.exists() and record.exists()):
            _compile_delayline(out, record, tag)
        _check_binary(out, uid)
        if record.read_text() == _record(tag, out):
            return out
    raise NetworkError(f"delay line binary {out} does not match the hashes recorded in "
                       f"{record.name} after a rebuild; remove both")


def _record(tag, binary):
    return f"source {tag}\nbinary {_sha256(binary)}\n"


def _check_binary(out, uid):
    st = os.lstat(out)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mode & (stat.S_IWGRP
                                                                        | stat.S_IWOTH):
        raise NetworkError(f"delay line binary {out}: not a regular file owned by uid {uid} "
                           f"and writable by it alone; remove it to rebuild")


def _compile_delayline(out, record, tag):
    gcc = shutil.which("gcc", path="/usr/local/bin:/usr/bin:/bin")
    if not gcc:
        raise NetworkError("building the delay line needs gcc (Makefile APT_PKGS)")
    fd, tmp = tempfile.mkstemp(prefix=".tb-delayline-", dir=out.parent)   # 0600, O_EXCL
    os.close(fd)
    try:
        r = subprocess.run([gcc, *DELAYLINE_CFLAGS, "-o", tmp, str(DELAYLINE_SRC),
                            *DELAYLINE_LIBS], capture_output=True, text=True,
                           env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C"})
        if r.returncode != 0:
            raise NetworkError(f"compiling {DELAYLINE_SRC.name} failed (libnetfilter-queue-dev "
                               f"installed?): {_first_error(r.stderr)}")
        os.chmod(tmp, 0o755)
        fd, tmp_record = tempfile.mkstemp(prefix=".tb-delayline-", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(_record(tag, tmp))
        os.chmod(tmp_record, 0o644)
        os.replace(tmp, out)          # binary first: a record never names a missing binary
        os.replace(tmp_record, record)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _first_error(stderr):
    lines = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.splitlines() or ["?"]
    return lines[0].strip()


class DelayLine:
    """One `tb-delayline` child holding NFQUEUE `queue_num` verdicts in the router namespace.

    Control is a line protocol on its stdin ('set DELAY_US JITTER_US DIST REORDER P_GB P_BG
    LOSS_GOOD LOSS_BAD'), each line acknowledged on stdout; stdin closing (this process died)
    makes it exit. The last four are the Gilbert-Elliott loss chain (all 0 but P_BG: off).
    """

    READY_TIMEOUT_S = 3.0   # compile is done before; binding a queue takes milliseconds
    ACK_TIMEOUT_S = 0.5

    def __init__(self, netns_path, queue_num, params, seed, registry=None):
        self.netns_path, self.queue_num, self.seed = netns_path, queue_num, seed
        self.registry = registry
        self.capacity = delayline_capacity(params)
        self.proc = None
        self._lock = threading.Lock()
        self._params = params

    def start(self):
        binary = delayline_binary()
        p = self._params
        argv = ["nsenter", f"--net={self.netns_path}", str(binary), str(self.queue_num),
                str(self.capacity), *self._args(p), str(self.seed)]
        # nsenter execs the binary (no fork for --net alone), so proc.pid is the delay line. It
        # dies with this process: stdin closes (EOF stops it), and when started by the main
        # thread the kernel also sends it SIGKILL (parent-death signal, kept across the exec).
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=lifecycle.die_with_parent())
        if self.registry is not None:
            self.registry.add_process(self.proc.pid, f"tb-delayline queue {self.queue_num}")
        line = self._read_line(self.READY_TIMEOUT_S)
        if line != "ready":
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.stop()
            raise NetworkError(f"delay line on NFQUEUE {self.queue_num} did not start: "
                               f"{(line or err).strip() or 'no answer'}")

    @staticmethod
    def _args(p):
        p_gb, p_bg = gilbert(p["loss"], p["loss_burst"]) if burst_loss(p) else (0.0, 1.0)
        return [str(int(round(p["delay"] * 1e6))), str(int(round(p["jitter"] * 1e6))),
                p["jitter_dist"], "1" if p["reorder"] else "0",
                f"{p_gb:.9g}", f"{p_bg:.9g}", "0", "1"]

    def _read_line(self, timeout_s):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if r else None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def configure(self, params):
        with self._lock:
            self._params = params
            if not self.alive():
                raise NetworkError(f"delay line on NFQUEUE {self.queue_num} is not running")
            self.proc.stdin.write("set " + " ".join(self._args(params)) + "\n")
            self.proc.stdin.flush()
            ack = self._read_line(self.ACK_TIMEOUT_S)
            if ack != "ok":
                raise NetworkError(f"delay line on NFQUEUE {self.queue_num} answered {ack!r}")

    def counters(self):
        """{'held', 'passed', 'dropped', 'lost', 'errors', 'late_sum_ns', 'late_max_ns'} from
        the delay line itself (late: release time - due time of passed packets, by its own
        clock), or {} when gone."""
        with self._lock:
            if not self.alive():
                return {}
            self.proc.stdin.write("stats\n")
            self.proc.stdin.flush()
            line = self._read_line(self.ACK_TIMEOUT_S) or ""
        return {k: int(v) for k, v in (f.split("=") for f in line.split() if "=" in f)}

    def stop(self):
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()     # EOF is the polite stop
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        self.proc = None


# ---------------------------------------------------------------- firewall (userspace backend)

class Firewall:
    """iptables state of the userspace backend in the router namespace: per direction a chain
    `TBWAN-<dir>` (link down, random loss) jumped to from FORWARD -o <iface>, and an NFQUEUE rule
    in mangle POSTROUTING when the delay line is on. Each change is one iptables-restore call."""

    def __init__(self, netns_path, registry=None):
        self.netns_path = netns_path
        self.registry = registry
        self.installed = {}   # direction -> iface

    def _run(self, argv, stdin=None, check=True):
        r = subprocess.run(["nsenter", f"--net={self.netns_path}", *argv], input=stdin,
                           capture_output=True, text=True)
        if check and r.returncode != 0:
            raise NetworkError(f"{' '.join(argv[:2])} in {self.netns_path}: "
                               f"{r.stderr.strip() or r.returncode}")
        return r

    def _undo_argv(self, *argv):
        return ["nsenter", f"--net={self.netns_path}", *argv]

    @staticmethod
    def chain(direction):
        return f"TBWAN-{direction}"

    def install(self, direction, iface):
        c = self.chain(direction)
        self._run(["iptables-restore", "-n"], stdin=f"*filter\n:{c} - [0:0]\nCOMMIT\n")
        jump = ["FORWARD", "-o", iface, "-j", c]
        if self._run(["iptables", "-C", *jump], check=False).returncode != 0:
            self._run(["iptables", "-A", *jump])   # not twice after a crashed run
        self.installed[direction] = iface
        if self.registry is not None:
            self.registry.add_undo_command(self._undo_argv("iptables", "-X", c))
            self.registry.add_undo_command(self._undo_argv("iptables", "-F", c))
            self.registry.add_undo_command(
                self._undo_argv("iptables", "-D", "FORWARD", "-o", iface, "-j", c))

    def sync(self, direction, up, loss):
        """Rewrite the direction's chain: DROP all when down, else drop with probability `loss`
        (0 when the delay line drops instead, for burst loss)."""
        c = self.chain(direction)
        rules = [f":{c} - [0:0]"]      # declaring a user chain under -n flushes it, atomically
        if not up:
            rules.append(f"-A {c} -j DROP")
        elif loss > 0:
            rules.append(f"-A {c} -m statistic --mode random --probability {loss:.9f} -j DROP")
        self._run(["iptables-restore", "-n"], stdin="*filter\n" + "\n".join(rules) + "\nCOMMIT\n")

    def queue_rule(self, direction, queue_num, on):
        iface = self.installed[direction]
        rule = ["POSTROUTING", "-o", iface, "-j", "NFQUEUE", "--queue-num", str(queue_num)]
        exists = self._run(["iptables", "-t", "mangle", "-C", *rule], check=False).returncode == 0
        if on and not exists:
            self._run(["iptables", "-t", "mangle", "-A", *rule])
            if self.registry is not None:
                self.registry.add_undo_command(self._undo_argv("iptables", "-t", "mangle", "-D",
                                                               *rule))
        elif not on and exists:
            self._run(["iptables", "-t", "mangle", "-D", *rule])

    def counters(self, direction):
        """Packets dropped by the direction's chain so far (loss + down), or None."""
        r = self._run(["iptables", "-nvxL", self.chain(direction)], check=False)
        if r.returncode != 0:
            return None
        return sum(int(line.split()[0]) for line in r.stdout.splitlines()[2:] if line.strip())

    def remove(self):
        for direction, iface in list(self.installed.items()):
            c = self.chain(direction)
            self._run(["iptables", "-t", "mangle", "-D", "POSTROUTING", "-o", iface, "-j",
                       "NFQUEUE", "--queue-num", str(DIRECTIONS.index(direction))], check=False)
            self._run(["iptables", "-D", "FORWARD", "-o", iface, "-j", c], check=False)
            self._run(["iptables", "-F", c], check=False)
            self._run(["iptables", "-X", c], check=False)
            del self.installed[direction]


def _needs_delayline(p):
    return p["delay"] > 0 or p["jitter"] > 0 or burst_loss(p)


# ---------------------------------------------------------------- the link

class Wan:
    """The two-direction WAN link on a router namespace; see the module docstring."""

    def __init__(self, netns_path, ifaces, params, backend="auto", seed=0, registry=None,
                 events=None):
        if set(ifaces) != set(DIRECTIONS) or set(params) != set(DIRECTIONS):
            raise ConfigError(f"expected ifaces and params for exactly {DIRECTIONS}")
        if backend not in ("auto", "netem", "userspace"):
            raise ConfigError(f"expected auto, netem or userspace, got {backend!r}",
                              key="network.wan.backend")
        self.netns_path = netns_path
        self.ifaces = dict(ifaces)
        self.params = {d: check_params(params[d], d) for d in DIRECTIONS}
        self.requested_backend = backend
        self.backend = None
        self.backend_reason = ""
        self.seed = seed
        self.registry = registry
        self.events = events
        self._ns = None
        self._index = {}
        self._delaylines = {}
        self._firewall = None
        self._lock = threading.RLock()
        self._closed_callback = False

    # -- lifecycle

    def start(self):
        """Install both directions; on any failure, remove what was installed and raise."""
        self._pick_backend()
        for d in DIRECTIONS:   # before anything is built
            self._check_backend_supports(d, self.params[d])
        _register_fifo_plugins()
        self._ns = _open_netns(self.netns_path)
        try:
            for d in DIRECTIONS:
                found = self._ns.link_lookup(ifname=self.ifaces[d])
                if not found:
                    raise NetworkError(f"interface {self.ifaces[d]} ({d} egress) not found in "
                                       f"{self.netns_path}", errno=errno_mod.ENODEV)
                self._index[d] = found[0]
            if self.backend == "userspace":
                self._firewall = Firewall(self.netns_path, self.registry)
            for d in DIRECTIONS:
                self._install(d)
        except BaseException:
            self.stop()
            raise
        if self.registry is not None and not self._closed_callback:
            self.registry.on_close(self.stop, "wan shaping")
            self._closed_callback = True
        self._event("wan_start", backend=self.backend, reason=self.backend_reason,
                    **{f"{d}_{k}": v for d in DIRECTIONS for k, v in self.describe(d).items()})
        return self

    def _pick_backend(self):
        if self.requested_backend == "auto":
            self.backend, self.backend_reason = probe_backend()
        else:
            self.backend = self.requested_backend
            self.backend_reason = f"backend {self.requested_backend} requested in the config"

    def stop(self):
        """Remove qdiscs, firewall rules and delay lines. Idempotent; never raises on 'gone'."""
        with self._lock:
            for dl in self._delaylines.values():
                dl.stop()
            self._delaylines.clear()
            if self._firewall is not None:
                self._firewall.remove()
                self._firewall = None
            if self._ns is not None:
                for d, idx in self._index.items():
                    with contextlib.suppress(Exception):
                        self._ns.tc("del", index=idx, handle=HTB_HANDLE, parent=TC_H_ROOT)
                with contextlib.suppress(Exception):
                    self._ns.close()
                self._ns = None
                self._index.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- installing one direction

    def _rtt_s(self):
        return sum(self.params[d]["delay"] for d in DIRECTIONS)

    def describe(self, direction):
        """What is installed for `direction`: rate, burst, queue kind/limit, delay, loss, up."""
        p = self.params[direction]
        kind, limit = queue_limit(p["queue"], p["rate"], self._rtt_s())
        return {"rate_bps": p["rate"], "burst_bytes": htb_burst_bytes(p["rate"]),
                "queue": f"{limit}{'B' if kind == 'bfifo' else 'p'}", "delay_s": p["delay"],
                "jitter_s": p["jitter"], "loss": p["loss"], "loss_burst": p["loss_burst"],
                "up": p["up"]}

    def _install(self, d):
        idx, p = self._index[d], self.params[d]
        with contextlib.suppress(Exception):   # a stale root qdisc from a crashed run
            self._ns.tc("del", index=idx, handle=HTB_HANDLE, parent=TC_H_ROOT)
        _netlink_call(f"adding htb root on {self.ifaces[d]}", self._ns.tc, "add", "htb",
                      index=idx, handle=HTB_HANDLE, default=0x10)
        self._set_class(d, "add-class")
        self._set_leaf(d, "add")
        if self.backend == "userspace":
            self._firewall.install(d, self.ifaces[d])
            self._firewall.sync(d, p["up"], self._iptables_loss(p))
            if _needs_delayline(p):
                self._ensure_delayline(d)

    @staticmethod
    def _iptables_loss(p):
        """Independent loss is iptables' job; burst loss is the delay line's."""
        return 0.0 if burst_loss(p) else p["loss"]

    def _set_class(self, d, command):
        rate = self.params[d]["rate"]
        burst = htb_burst_bytes(rate)
        _netlink_call(f"{command} htb 1:10 rate {units.fmt_rate(rate)} on {self.ifaces[d]}",
                      self._ns.tc, command, "htb", index=self._index[d], handle=CLASS_HANDLE,
                      parent=HTB_HANDLE, rate=f"{int(rate)}bit", ceil=f"{int(rate)}bit",
                      burst=burst, cburst=burst, quantum=htb_quantum_bytes(rate))

    def _set_leaf(self, d, command):
        p = self.params[d]
        idx, name = self._index[d], self.ifaces[d]
        if self.backend == "netem":
            limit = queue_packets(p["queue"], p["rate"], self._rtt_s())
            loss = 100.0 if not p["up"] else p["loss"] * 100
            # netem: times in microseconds, loss in percent, limit in packets
            _netlink_call(f"{command} netem 10: on {name}", self._ns.tc, command, "netem",
                          index=idx, handle=LEAF_HANDLE, parent=CLASS_HANDLE,
                          delay=int(p["delay"] * 1e6), jitter=int(p["jitter"] * 1e6),
                          loss=loss, limit=limit, **({"gap": 0} if p["reorder"] else {}))
        else:
            kind, limit = queue_limit(p["queue"], p["rate"], self._rtt_s())
            if command != "add":   # bfifo <-> pfifo needs a new qdisc, not a change
                command = "replace"
            _netlink_call(f"{command} {kind} 10: limit {limit} on {name}", self._ns.tc,
                          command, kind, index=idx, handle=LEAF_HANDLE, parent=CLASS_HANDLE,
                          limit=limit)

    def _check_backend_supports(self, d, p):
        if self.backend == "netem" and burst_loss(p):
            # pyroute2 0.9.7 cannot encode TCA_NETEM_LOSS (netem's gemodel); refuse rather than
            # silently emulating independent loss
            raise ConfigError("burst loss (loss_burst) needs the userspace backend here: "
                              "pyroute2 cannot encode netem's gemodel",
                              key=f"network.wan.{d}.loss_burst")

    def _ensure_delayline(self, d):
        dl = self._delaylines.get(d)
        if dl is not None and dl.alive():
            dl.configure(self.params[d])
            return
        dl = DelayLine(self.netns_path, DIRECTIONS.index(d), self.params[d],
                       seed=self.seed * 2 + DIRECTIONS.index(d), registry=self.registry)
        dl.start()
        self._delaylines[d] = dl
        self._firewall.queue_rule(d, DIRECTIONS.index(d), on=True)

    # -- changing the link while it runs

    def set(self, direction=None, **changes):
        """Change rate=, delay=, jitter=, loss=, up=, queue= of one direction (None = both).

        Values are in emulation units (bit/s, seconds, probability) or unit strings ('50Mbit').
        Returns the time it took in seconds; logs a `wan_set` event.
        """
        unknown = set(changes) - set(SETTABLE)
        if unknown:
            raise ConfigError(f"unknown link setting(s) {sorted(unknown)}; expected {SETTABLE}")
        dirs = DIRECTIONS if direction is None else (direction,)
        if any(d not in DIRECTIONS for d in dirs):
            raise ConfigError(f"expected direction kv, request or None, got {direction!r}")
        t0 = time.monotonic()
        with self._lock:
            if self._ns is None:
                raise NetworkError("Wan.set() before start() or after stop()")
            new = {d: check_params({**self.params[d], **changes}, d) for d in dirs}
            for d in dirs:
                self._check_backend_supports(d, new[d])
            for d in dirs:
                self._apply(d, new[d])
        took = time.monotonic() - t0
        self._event("wan_set", direction=direction or "both", apply_ms=round(took * 1e3, 3),
                    **{k: v for k, v in changes.items()})
        return took

    def _apply(self, d, p):
        old = self.params[d]
        self.params[d] = p
        changed = {k for k in SETTABLE if p[k] != old[k]}
        if "rate" in changed:
            self._set_class(d, "change-class")
        if self.backend == "netem":
            if changed & {"delay", "jitter", "loss", "loss_burst", "up", "queue", "rate"}:
                self._set_leaf(d, "change")
            return
        if "queue" in changed or (p["queue"] is None and changed & {"rate", "delay"}):
            self._set_leaf(d, "replace")     # the default queue follows the BDP
        if changed & {"loss", "loss_burst", "up"}:
            self._firewall.sync(d, p["up"], self._iptables_loss(p))
        if changed & {"delay", "jitter", "loss", "loss_burst"} and (
                _needs_delayline(p) or d in self._delaylines):
            self._ensure_delayline(d)

    # -- counters

    def stats(self):
        """Per direction: tx_bytes, tx_packets, backlog_bytes, backlog_packets, drops (bottleneck
        queue), up, rate_bps, from one qdisc dump per interface."""
        out = {}
        with self._lock:
            if self._ns is None:
                raise NetworkError("Wan.stats() before start() or after stop()")
            for d in DIRECTIONS:
                msgs = list(self._ns.tc("dump", index=self._index[d]))
                # the HTB root's counters include its leaf's (drops, backlog propagate up)
                root = _leaf_stats(msgs, HTB_HANDLE) or {}
                out[d] = {"tx_bytes": root.get("bytes", 0), "tx_packets": root.get("packets", 0),
                          "backlog_bytes": root.get("backlog", 0),
                          "backlog_packets": root.get("qlen", 0),
                          "drops": root.get("drop", 0),
                          "up": self.params[d]["up"], "rate_bps": self.params[d]["rate"]}
        return out

    def delayline_counters(self):
        """{'kv': {'held','passed','dropped'}, ...} for directions with a running delay line."""
        return {d: dl.counters() for d, dl in self._delaylines.items()}

    def _event(self, kind, **fields):
        if self.events is not None:
            self.events(kind, **fields)
