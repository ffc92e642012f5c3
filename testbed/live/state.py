"""A run watched while it goes: the run directory's live files, tailed, as one typed state.

The orchestrator and its workers already write everything a watcher needs while the run goes
(testbed/records.py): the client's records (`requests.jsonl`, a `sent` and a `done` line per
request), `events.csv` (health transitions, faults, role conversions, worker deaths),
`timeseries.csv` (the WAN router's kernel counters at 20 Hz), `scheduler.csv` (the adaptive
threshold's decisions) and `runtime.json` (instances, roles, scale). With `--metrics` the prefill,
decode and dual-role workers add `status/<name>.json` (workers/status.py: running and waiting
requests, decode memory, a dual-role worker's role in force), the one thing no other file
carries. `RunState.poll()` reads what was appended
since the last poll (whole lines only: a line being written waits for the next poll) and
returns the requests that finished meanwhile as `Finished` records; everything else is the
state in force (`link`, `threshold`, `roles`, `health`, `faults`, `status`).

Every value here is real-world: emulated stamps and byte counts become real-world seconds and
bytes through the run's `testbed.scale.Scale` (`real_s`, `real_rate`, `real_bytes`). Definitions
are those of `testbed.metrics` (vLLM `bench serve`): TTFT = first token at the client - send,
E2EL = last token - send, TPOT = (E2EL - TTFT) / (tokens - 1), ITL = gaps between the decode
worker's token stamps. The exporter (testbed/live/exporter.py) and the terminal view
(testbed/live/view.py) both read this; neither writes anything into the run directory.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import pathlib

import numpy as np

from testbed.records import RequestRecord, RunDir, sent_from_line
from testbed.runtime import WorkerRuntime

DIRECTIONS = ("kv", "request")
# The WAN's datacenters: the KV direction leaves the PrfaaS cluster, requests leave the local one.
DIRECTION_DC = {"kv": "prfaas", "request": "local"}
# Egress is the mean over this much of the machine's (emulated) clock: a scrape every 2 s
# (dashboards/prometheus.yml) samples windows that tile the run.
EGRESS_WINDOW_S = 2.0


class Tail:
    """The whole lines appended to a file since the last read; a line cut mid-write waits."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.pos = 0
        self.partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(chunk)
        data = self.partial + chunk
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        return data[:cut].decode(errors="replace").splitlines()


@dataclasses.dataclass(frozen=True)
class Finished:
    """One request's `done` record, real-world seconds (None where it does not apply)."""

    id: int
    ok: bool
    decode: str                 # the decode instance that streamed it ("" when none)
    prefill: str
    route: str                  # local | remote | ""
    ttft_s: float | None
    e2el_s: float | None
    tpot_s: float | None
    itl_s: np.ndarray           # gaps between the decode worker's token stamps
    first_token_lag_s: float | None   # decode stamp of the first token -> client arrival
    cached_tokens: int


def finished(rec: RequestRecord, scale) -> Finished:
    """A `done` record of requests.jsonl as real-world durations."""
    ok = rec.status == "ok"
    send, first, last = rec.send_time, rec.first_token, rec.last_token
    ttft = scale.real_s(first - send) if ok and first and send else None
    e2el = scale.real_s(last - send) if ok and last and send else None
    n = int(rec.n_tokens or 0)
    tpot = (e2el - ttft) / (n - 1) if ttft is not None and e2el is not None and n > 1 else None
    times = np.asarray(rec.token_times or [], dtype=float)     # the decode worker's stamps
    first_stamp = float(times[0]) if times.size else None
    itl = scale.real_s(np.diff(times)) if ok else np.empty(0)
    lag = scale.real_s(first - first_stamp) if ok and first and first_stamp else None
    return Finished(id=int(rec.id), ok=ok, decode=rec.decode_instance or "",
                    prefill=rec.prefill_instance or "", route=rec.route or "",
                    ttft_s=ttft, e2el_s=e2el, tpot_s=tpot, itl_s=itl, first_token_lag_s=lag,
                    cached_tokens=int(rec.cached_len or 0))


@dataclasses.dataclass
class Link:
    """One WAN direction as the kernel counted it (timeseries.csv), real-world units."""

    egress_gbps: float = 0.0        # mean over the last EGRESS_WINDOW_S (emulated)
    link_gbps: float = 0.0          # the link rate in force
    up: bool = True
    backlog_real_bytes: float = 0.0
    drops: int = 0                  # packets dropped at the bottleneck queue, cumulative
    tx_real_bytes: float = 0.0      # bytes sent since the run's first sample
    window_end: float = 0.0         # Unix time of the newest sample the egress covers


@dataclasses.dataclass(frozen=True)
class Fault:
    fault: str                      # the YAML index
    kind: str
    target: str
    active: bool


class RunState:
    """One variant's run directory, tailed. `poll()` -> the requests finished since the last."""

    def __init__(self, run_dir):
        self.dir = RunDir(run_dir)
        self.rt: WorkerRuntime | None = None
        self.records = Tail(self.dir.records)
        self.events = Tail(self.dir.events)
        self.timeseries = Tail(self.dir.timeseries)
        self.scheduler = Tail(self.dir.scheduler)
        self.ts_columns = None
        self.ts_window = collections.deque()      # (time, {direction: tx_bytes})
        self.ts_first = None
        self.sent, self.done = set(), set()
        self.completed = self.failed = 0
        self.offloaded = self.routed = 0
        self.ttfts = []                           # real-world s of every completed request
        self.link = {d: Link() for d in DIRECTIONS}
        self.threshold = None
        self.roles = {}                           # instance -> role in force
        self.down = {}                            # instance -> why (health, exit)
        self.faults = {}                          # (fault, occurrence) -> Fault
        self.status = {}                          # instance -> status/<name>.json
        self.input_len = None                     # request id -> input tokens (builtin client)
        self.client_finished = False

    # -- what the run is
    @property
    def started(self) -> bool:
        return self.rt is not None

    @property
    def experiment(self) -> str:
        return self.rt.name if self.rt else ""

    @property
    def variant(self) -> str:
        return (self.rt.label or self.rt.scheduler.policy) if self.rt else ""

    @property
    def scale(self):
        return self.rt.scale

    @property
    def ended(self) -> bool:
        """The variant's teardown wrote metadata.json: nothing more will be appended."""
        return self.dir.metadata.exists()

    @property
    def in_flight(self) -> int:
        return len(self.sent - self.done)

    def instance(self, name):
        return self.rt.instances.get(name) if self.rt else None

    def dc(self, name) -> str:
        inst = self.instance(name)
        return inst.dc if inst else ""

    # -- reading
    def poll(self) -> list[Finished]:
        if self.rt is None:
            if not self.dir.runtime.exists():
                return []
            self.rt = WorkerRuntime.load(self.dir.runtime)
            self.roles = {n: i.role for n, i in self.rt.instances.items()
                          if i.role in ("prefill", "decode")}
            self.threshold = self.rt.scheduler.threshold or None
        out = self._records()
        self._events()
        self._timeseries()
        self._scheduler()
        self._status()
        return out

    def _records(self):
        out = []
        for line in self.records.lines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            ev = obj.get("ev")
            if ev == "sent":
                self.sent.add(sent_from_line(obj).id)
            elif ev == "done":
                out.append(self._done(finished(RequestRecord.from_line(obj), self.scale)))
            elif ev == "finished":
                self.client_finished = True
        return out

    def _done(self, f: Finished) -> Finished:
        self.done.add(f.id)
        self.sent.add(f.id)
        if f.ok:
            self.completed += 1
            self.ttfts.append(f.ttft_s)
        else:
            self.failed += 1
        if f.route:
            self.routed += 1
            self.offloaded += f.route == "remote"
        return f

    def offload_share(self) -> float | None:
        return self.offloaded / self.routed if self.routed else None

    def input_tokens(self, rid) -> int | None:
        """The request's input length from workload.parquet, with the prefix cache on (the
        built-in client's list; an external client's requests are numbered by the front door:
        None). Without the cache, None: nothing is looked up, and pyarrow's import (a quarter
        of a second) is not paid."""
        if self.input_len is None:
            self.input_len = {}
            external = self.dir.frontdoor.exists()
            if self.rt and self.rt.cache.enabled and self.dir.workload.exists() and not external:
                import pyarrow.parquet as pq     # only when a prefix cache metric asks
                t = pq.read_table(self.dir.workload, columns=["id", "input_len"])
                self.input_len = dict(zip(t.column("id").to_pylist(),
                                          t.column("input_len").to_pylist()))
        return self.input_len.get(rid)

    def _events(self):
        for row in csv.reader(self.events.lines()):
            if len(row) < 3 or row[0] == "time":
                continue
            kind = row[1]
            f = dict(kv.partition("=")[::2] for kv in row[2].split(" ") if "=" in kv)
            if kind == "health":
                if f.get("state") == "down":
                    self.down[f.get("instance", "")] = f.get("reason", "down")
                else:
                    self.down.pop(f.get("instance", ""), None)
            elif kind == "worker_died":
                self.down[f.get("name", "")] = f"exited {f.get('code', '')}"
            elif kind == "worker_restarted":
                self.down.pop(f.get("name", ""), None)
            elif kind in ("fault_inject", "fault_end"):
                key = (f.get("fault", ""), f.get("occurrence", ""))
                self.faults[key] = Fault(fault=f.get("fault", ""), kind=f.get("fault_kind", ""),
                                         target=f.get("target", ""),
                                         active=kind == "fault_inject")
            elif kind == "role" and f.get("state") == "done":
                self.roles[f.get("instance", "")] = f.get("to", "")

    def _timeseries(self):
        for row in csv.reader(self.timeseries.lines()):
            if self.ts_columns is None:
                self.ts_columns = {c: i for i, c in enumerate(row)}
                continue
            try:
                self._sample(row)
            except (IndexError, ValueError):
                continue            # a malformed row: the next one says as much

    def _sample(self, row):
        col, s = self.ts_columns, self.scale
        t = float(row[col["time"]])
        tx = {d: int(row[col[f"{d}_tx_bytes"]]) for d in DIRECTIONS}
        if self.ts_first is None:
            self.ts_first = tx
        self.ts_window.append((t, tx))
        while len(self.ts_window) > 2 and t - self.ts_window[1][0] >= EGRESS_WINDOW_S:
            self.ts_window.popleft()
        t0, tx0 = self.ts_window[0]
        for d in DIRECTIONS:
            link = self.link[d]
            if t > t0:
                link.egress_gbps = s.real_rate((tx[d] - tx0[d]) * 8 / (t - t0)) / 1e9
            link.link_gbps = float(row[col[f"{d}_link_gbps"]])
            link.up = row[col[f"{d}_up"]] == "1"
            link.backlog_real_bytes = s.real_bytes(float(row[col[f"{d}_backlog_bytes"]]))
            link.drops = int(row[col[f"{d}_drops"]])
            link.tx_real_bytes = s.real_bytes(tx[d] - self.ts_first[d])
            link.window_end = t

    def _scheduler(self):
        for line in self.scheduler.lines():
            head, _, _ = line.partition(",")
            if head == "time":
                continue
            try:
                self.threshold = int(float(line.split(",")[1]))
            except (IndexError, ValueError):
                continue

    def _status(self):
        d = self.dir.status
        if not d.is_dir():
            return
        for p in d.glob(self.dir.status_file("*").name):
            try:
                self.status[p.stem] = json.loads(p.read_text())
            except (OSError, ValueError):
                continue            # renamed away between the glob and the read

    def role_counts(self) -> dict:
        """{(role, datacenter): instances} of the prefill and decode roles in force."""
        out = collections.Counter((r, self.dc(n)) for n, r in self.roles.items())
        return dict(out)


def run_dirs(top) -> list[pathlib.Path]:
    """The variant run directories at or below `top` that have started (a runtime.json), in
    the order they started: top/<label>/, or top/<label>/r<i>/ of a run with replicates."""
    top = pathlib.Path(top)
    if (top / RunDir.RUNTIME).exists():
        return [top]
    found = [p.parent for pattern in (f"*/{RunDir.RUNTIME}", f"*/*/{RunDir.RUNTIME}")
             for p in top.glob(pattern)]
    return sorted(found, key=lambda p: (p / RunDir.RUNTIME).stat().st_mtime)


class Watch:
    """Every variant of one `testbed run` (or the one of `testbed up`), as it appears."""

    def __init__(self, top):
        self.top = pathlib.Path(top)
        self.runs: dict[pathlib.Path, RunState] = {}

    def poll(self) -> list[tuple[RunState, list[Finished]]]:
        for d in run_dirs(self.top):
            if d not in self.runs:
                self.runs[d] = RunState(d)
        return [(r, r.poll()) for r in self.runs.values()]
