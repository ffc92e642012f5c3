"""The delay line: `tb-delayline` (delayline.c), built once, checked before every use, and
driven as a supervised child per WAN direction.

Place in the architecture: the userspace backend of `testbed.net.wan.Wan` (kernels without
netem, such as these machines) holds each packet of a direction for its delay (+ jitter), and
drops in bursts from a Gilbert chain, in a C program that holds NFQUEUE verdicts on a
microsecond timer in the router namespace. It runs as a child registered with the run's
`Registry` and exits on its own when this process goes away (its control pipe closes).
`delayline_binary` compiles it from delayline.c on first use into a private cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import select
import shutil
import stat
import subprocess
import tempfile
import threading

from testbed import lifecycle
from testbed.errors import NetworkError
from testbed.net.linkmodel import FRAME_BYTES, Link, burst_loss, gilbert, steady_faults

MAX_NFQUEUE_PACKETS = 65536
DELAYLINE_SRC = pathlib.Path(__file__).with_name("delayline.c")


def delayline_capacity(link: Link) -> int:
    """Packets the delay line may hold: 4x what the link carries during the longest delay.

    Arrivals run ahead of the link rate (slow start doubles, TSO bursts of 43 frames), so 2x was
    measured to overflow at 1 Gbit/s, 5 ms (375 kernel queue drops in 4 s); 4x did not."""
    longest_s = link.delay_s + 4 * link.jitter_s
    in_flight = link.rate_bps / 8 * longest_s / FRAME_BYTES
    return int(min(max(4 * in_flight + 1024, 4096), MAX_NFQUEUE_PACKETS))


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

    def __init__(self, netns_path, queue_num, link: Link, seed, registry=None):
        self.netns_path, self.queue_num, self.seed = netns_path, queue_num, seed
        self.registry = registry
        self.capacity = delayline_capacity(link)
        self.proc = None
        self._lock = threading.Lock()
        self._link = link
        self.offset_s = 0.0     # the path's fixed cost, subtracted (testbed.net.calibrate)

    def start(self):
        binary = delayline_binary()
        p = self._link
        argv = ["nsenter", f"--net={self.netns_path}", str(binary), str(self.queue_num),
                str(self.capacity), *self._args(p, self.offset_s), str(self.seed)]
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
        if steady_faults(p):
            with self._lock:
                self._send("faults " + " ".join(self._faults(p)))

    @staticmethod
    def _args(link, offset_s=0.0):
        """The `set` fields of `link`; the delay held is the configured one less `offset_s`
        (the fixed cost measured by `testbed.net.calibrate`), never below 0."""
        p_gb, p_bg = gilbert(link.loss, link.loss_burst) if burst_loss(link) else (0.0, 1.0)
        held_s = max(0.0, link.delay_s - offset_s)
        return [str(int(round(held_s * 1e6))), str(int(round(link.jitter_s * 1e6))),
                link.jitter_dist, "1" if link.reorder else "0",
                f"{p_gb:.9g}", f"{p_bg:.9g}", "0", "1"]

    def _read_line(self, timeout_s):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if r else None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def configure(self, link: Link):
        with self._lock:
            self._link = link
            if not self.alive():
                raise NetworkError(f"delay line on NFQUEUE {self.queue_num} is not running")
            self._send("set " + " ".join(self._args(link, self.offset_s)))
            self._send("faults " + " ".join(self._faults(link)))

    @staticmethod
    def _faults(link):
        return [f"{link.corrupt:.9g}", f"{link.duplicate:.9g}", f"{link.reorder_prob:.9g}",
                str(link.reorder_gap)]

    def _send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ack = self._read_line(self.ACK_TIMEOUT_S)
        if ack != "ok":
            raise NetworkError(f"delay line on NFQUEUE {self.queue_num} answered {ack!r} to "
                               f"{line.split()[0]}")

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
