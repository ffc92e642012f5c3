"""Run-directory files between the orchestrator and the hosts that do not share its storage.

    orchestrator's run dir                               a host's copy (agents.Launcher)
      inputs at spawn: runtime.json, workload.parquet ->
      live: ready/*, control/*, timeseries.csv        ->
                                                      <- live: ready/*, requests.jsonl,
                                                         status/* (--metrics)
                                                      <- at the end: everything else (logs/,
                                                         records), events.csv rows appended

The runner and the workers talk through files of the run directory (a worker's ready file, the
client's start time, a `slow` fault's control file, the kernel counters the adaptive scheduler
reads, the client's records the progress bar counts). On one machine, or where every host
mounts the run directory at the same path, they are simply there. Elsewhere each host's
launcher keeps a node-local copy (`agents.host_run_dir`), and a `HostFiles` per such host copies
files through the launcher's `listing`/`read`/`write` calls (Ray, bytes in chunks): `Mirror`
syncs the live ones every `PERIOD_S`, `collect` brings the rest back at the end of the variant
(also on errors and Ctrl-C: the backend's teardown), at the same relative paths as on Mininet.
A file the orchestrator already has under that path (two hosts writing one name) is kept as
`<path>.<host>` (the backend records it in events.csv).

`call(method, *args)` is the launcher's method, run (`ray.get` of an actor call, or the
`Launcher` itself in unit tests).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading

from testbed.records import RunDir

CHUNK = 4 << 20          # bytes per read/write call
PERIOD_S = 0.05
PUSH_LIVE = (RunDir.READY + "/", RunDir.CONTROL + "/", RunDir.TIMESERIES)
PULL_LIVE = (RunDir.READY + "/", RunDir.RECORDS, RunDir.STATUS + "/")   # status/: --metrics
GROWING = (RunDir.RECORDS, RunDir.TIMESERIES)   # only appended to: copied from where we were
APPENDED = (RunDir.EVENTS,)     # rows of the host's processes, appended to the orchestrator's


def matches(rel, prefixes):
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes)


def hidden(rel):
    """A file being written (`.NAME.part`, the runner's `.tmp`): never copied."""
    name = pathlib.PurePath(rel).name
    return name.startswith(".") or name.endswith(".tmp")


class HostFiles:
    """One host's copy of the run directory, seen from the orchestrator.

    `origins` ({relative path: host}) is shared by every host's `HostFiles`: a file pulled from
    a host is pushed to the others, never back to it."""

    def __init__(self, name, call, run_dir, origins=None):
        self.name, self.call, self.dir = name, call, pathlib.Path(run_dir)
        self.origins = {} if origins is None else origins
        self.pushed = {}    # rel -> (size, mtime_ns) of the orchestrator's file last pushed
        self.pulled = {}    # rel -> (bytes copied, the host's mtime_ns) of a host's file
        self.lock = threading.Lock()

    # ---- orchestrator -> host

    def push(self, rel):
        """The orchestrator's file `rel` to the host, when it changed since it was last pushed
        (a growing file from where the last push ended)."""
        try:
            with open(self.dir / rel, "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_size, st.st_mtime_ns)
                last = self.pushed.get(rel)
                if last == key:
                    return
                offset = last[0] if last and rel in GROWING and st.st_size >= last[0] else 0
                f.seek(offset)
                data = f.read(st.st_size - offset)
        except FileNotFoundError:       # replaced or removed since listed
            return
        for i in range(0, max(len(data), 1), CHUNK):
            self.call("write", rel, data[i:i + CHUNK], offset + i)
        self.pushed[rel] = key

    def push_inputs(self, paths):
        """The files under the run directory among `paths` (a worker's argv) to the host."""
        with self.lock:
            for p in map(pathlib.Path, paths):
                with contextlib.suppress(ValueError):
                    rel = p.relative_to(self.dir)
                    if (self.dir / rel).is_file():
                        self.push(str(rel))

    def _push_live(self):
        for rel in sorted(self._orchestrator_files(PUSH_LIVE)):
            if self.origins.get(rel) != self.name:
                self.push(rel)

    def _orchestrator_files(self, prefixes):
        for p in prefixes:
            path = self.dir / p
            if p.endswith("/"):
                if path.is_dir():
                    yield from (str(f.relative_to(self.dir)) for f in path.rglob("*")
                                if f.is_file() and not hidden(f.name))
            elif path.is_file():
                yield p

    # ---- host -> orchestrator

    def _read(self, rel, offset, size):
        """The host's bytes of `rel` from `offset` up to `size` (what it was when listed)."""
        parts = []
        while offset < size:
            data = self.call("read", rel, offset, min(CHUNK, size - offset))
            if not data:
                break
            parts.append(data)
            offset += len(data)
        return b"".join(parts)

    def pull(self, rel, listed, dest=None):
        """The host's file `rel` (`listed`: its [size, mtime_ns]) into the orchestrator's
        directory at `dest` (default: the same path), when it changed since last pulled."""
        size, mtime = listed
        last = self.pulled.get(rel)
        if last is not None and last == (size, mtime):
            return
        offset = last[0] if last and rel in GROWING and size >= last[0] else 0
        data = self._read(rel, offset, size)
        path = self.dir / (dest or rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        if offset == 0:
            tmp = path.with_name(f".{path.name}.part")
            tmp.write_bytes(data)
            tmp.replace(path)
        else:
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(data)
        self.pulled[rel] = (offset + len(data), mtime)
        self.origins[dest or rel] = self.name

    def _append(self, rel, listed):
        """The host's rows of an append-only log (events.csv) after the orchestrator's."""
        data = self._read(rel, 0, listed[0])
        if data:
            with open(self.dir / rel, "ab") as f:
                f.write(data if data.endswith(b"\n") else data + b"\n")

    # ---- rounds

    def sync(self):
        """One round: the live files both ways."""
        with self.lock:
            for rel, listed in self.call("listing").items():
                if matches(rel, PULL_LIVE) and rel not in self.pushed and not hidden(rel):
                    self.pull(rel, listed)
            self._push_live()

    def collect(self):
        """Everything the host's processes wrote, into the orchestrator's run directory (after
        they ended); [(path, kept as)] of files the directory already had under that path."""
        renamed = []
        with self.lock:
            for rel, listed in sorted(self.call("listing").items()):
                if rel in self.pushed or hidden(rel):
                    continue                # the orchestrator's own input, or a cut copy
                if rel in APPENDED:
                    self._append(rel, listed)
                elif rel in self.pulled or not (self.dir / rel).exists():
                    self.pull(rel, listed)
                else:
                    self.pull(rel, listed, dest=f"{rel}.{self.name}")
                    renamed.append((rel, f"{rel}.{self.name}"))
        return renamed


class Mirror:
    """`HostFiles.sync` of every host every `period_s`, on a thread, until `stop()`."""

    def __init__(self, hosts, period_s=PERIOD_S):
        self.hosts, self.period_s = list(hosts), period_s
        self.errors = {}        # host -> (count, last error)
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="run-files", daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.period_s):
            self.round()

    def round(self):
        for h in self.hosts:
            try:
                h.sync()
            except Exception as e:    # noqa: BLE001  a host gone: its collection says so
                n, _ = self.errors.get(h.name, (0, None))
                self.errors[h.name] = (n + 1, f"{type(e).__name__}: {e}")

    def stop(self):
        """Stop the thread, then one last round; the errors, one line per host."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.round()
        return [f"syncing files with host {h}: {n} failed rounds, last: {e}"
                for h, (n, e) in self.errors.items()]
