"""Records: the run directory's file names and the typed records every process shares.

Place in the architecture: the floor just above units/errors/scale/clocks. Standard library
only (no pandas, numpy, yaml), so the workers import it as the orchestrator and analysis do:

- `RunDir` names every file and directory of a run directory; no other module spells one
  (tests/test_layers.py checks it). `testbed.rundir` adds the loaders that need pandas/yaml.
- `SentRecord`, `RequestRecord`: the lines of `requests.jsonl`, written by the built-in client
  (workers/client.py) and the front door (workers/frontdoor.py) through `RecordLog`, read
  back typed by `read_records` (token times expanded, every stamp on the orchestrator's clock
  when the run recorded clock offsets). Analysis reads requests through these and nothing else.
- `DecisionRecord`: a line of `decisions.jsonl`, a routing decision (or placement) and the book
  it read, by the scheduler and the simulator; `read_decisions` reads it (testbed/sim/replay.py).
- `EventLog` appends rows to `events.csv` (the runner and every worker); `read_events` is the
  one reader, and it puts each row a worker wrote on the orchestrator's clock.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import sys
import threading
import time

from testbed import clocks, tokentimes


class RunDir:
    """Named paths of one run directory (a variant's own directory, not the experiment's top)."""

    CONFIG = "config.yaml"              # the resolved experiment
    METADATA = "metadata.json"          # versions, link fidelity, counters, schema
    RUNTIME = "runtime.json"            # what the workers read: instances, scale (emulated)
    DEPLOYMENT = "deployment.json"      # the compiled Deployment (testbed.deploy)
    WORKLOAD = "workload.parquet"       # the request list
    RECORDS = "requests.jsonl"          # the client's (or front door's) raw records
    FRONTDOOR = "frontdoor.jsonl"       # the front door's per-HTTP-request rows
    TRACE = "trace.jsonl"               # the workload as a mooncake trace (external clients)
    CLIENT_ARGV = "client_argv.json"    # an external client's command line
    UP = "up.json"                      # `testbed up`: the addresses it serves on
    EVENTS = "events.csv"
    TIMESERIES = "timeseries.csv"       # kernel counters of the WAN router, 20 Hz
    SCHEDULER = "scheduler.csv"         # the adaptive threshold's decisions
    DECISIONS = "decisions.jsonl"       # the router's decisions with the book each one read
    REQUESTS = "requests.parquet"       # analysis: one row per request (real-world)
    TOKENS = "tokens.parquet"           # analysis: one row per output token
    SUMMARY = "summary.json"            # analysis: the run's metrics (real-world)
    REPORT = "report.md"
    SWEEP = "sweep.csv"                 # at an experiment's top: one row per run
    REPLICATES = "replicates.csv"       # at an experiment's top: median and CI per label, metric
    LIVE = "live.json"                  # at an experiment's top: the --metrics exporter's run
    LIVE_LOG = "live.log"               # at an experiment's top: the exporter's output
    FAILURE_MATRIX = "failure_matrix.csv"
    FAILURE_MATRIX_MD = "failure_matrix.md"
    CONFORMANCE = "conformance.csv"             # with WAN faults (testbed.faults.write_matrix)
    CONFORMANCE_MD = "conformance.md"
    CACHE_POOL = "cache_{dc}.json"      # a datacenter's prefix cache pool at its exit
    LOGS, FIGURES = "logs", "figures"   # logs/<instance>.log
    PAPER_FIGURES = "paper"             # in figures/: `testbed plot --style paper`'s PDFs
    CAPTIONS = "captions.md"            # in figures/: caption stubs of the paper figures
    LOAD_CURVE = "load_curve.csv"       # at an experiment's top: the load sweep per policy, load
    READY = "ready"                     # ready/<instance>, ready/start_at, ...
    CONTROL = "control"                 # control/<instance>.json (the `slow` fault)
    STATUS = "status"                   # status/<instance>.json: live state, only under --metrics
    VLLM = "vllm"                       # vllm/<instance>.json: a vLLM server's PIDs and bytes
    KV_EVENTS, KV_EVENTS_SUMMARY = "kv_events.csv", "kv_events.json"   # vLLM: workers/kvfeed.py
    AIPERF = "aiperf"                   # aiperf's artifact directory
    AIPERF_RECORDS, AIPERF_AGGREGATE = "profile_export.jsonl", "profile_export_aiperf.json"
    VLLM_BENCH = "vllm_bench"           # `vllm bench serve`'s result directory
    VLLM_BENCH_RESULT = "result.json"   # its --save-detailed result
    VLLM_BENCH_CLOCK = "clock.json"     # Unix time minus its perf_counter (workers/vllm_bench.py)
    START_AT = "start_at"               # in ready/: arrival 0 for the built-in client
    FIRST_REQUEST = "first_request"     # in ready/: an external client's first arrival
    FIRST_TOKENS = "first_tokens"       # in ready/: a pilot step's client has every first token

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __truediv__(self, name):
        return self.path / name

    def __fspath__(self):
        return str(self.path)

    def __repr__(self):
        return f"RunDir({str(self.path)!r})"

    config = property(lambda self: self.path / self.CONFIG)
    metadata = property(lambda self: self.path / self.METADATA)
    runtime = property(lambda self: self.path / self.RUNTIME)
    deployment = property(lambda self: self.path / self.DEPLOYMENT)
    workload = property(lambda self: self.path / self.WORKLOAD)
    records = property(lambda self: self.path / self.RECORDS)
    frontdoor = property(lambda self: self.path / self.FRONTDOOR)
    trace = property(lambda self: self.path / self.TRACE)
    client_argv = property(lambda self: self.path / self.CLIENT_ARGV)
    up = property(lambda self: self.path / self.UP)
    events = property(lambda self: self.path / self.EVENTS)
    timeseries = property(lambda self: self.path / self.TIMESERIES)
    scheduler = property(lambda self: self.path / self.SCHEDULER)
    decisions = property(lambda self: self.path / self.DECISIONS)
    requests = property(lambda self: self.path / self.REQUESTS)
    tokens = property(lambda self: self.path / self.TOKENS)
    summary = property(lambda self: self.path / self.SUMMARY)
    report = property(lambda self: self.path / self.REPORT)
    sweep = property(lambda self: self.path / self.SWEEP)
    replicates = property(lambda self: self.path / self.REPLICATES)
    live = property(lambda self: self.path / self.LIVE)
    live_log = property(lambda self: self.path / self.LIVE_LOG)
    failure_matrix = property(lambda self: self.path / self.FAILURE_MATRIX)
    failure_matrix_md = property(lambda self: self.path / self.FAILURE_MATRIX_MD)
    conformance = property(lambda self: self.path / self.CONFORMANCE)
    conformance_md = property(lambda self: self.path / self.CONFORMANCE_MD)
    logs = property(lambda self: self.path / self.LOGS)
    figures = property(lambda self: self.path / self.FIGURES)
    ready = property(lambda self: self.path / self.READY)
    control = property(lambda self: self.path / self.CONTROL)
    status = property(lambda self: self.path / self.STATUS)
    vllm = property(lambda self: self.path / self.VLLM)
    aiperf = property(lambda self: self.path / self.AIPERF)
    aiperf_records = property(lambda self: self.aiperf / self.AIPERF_RECORDS)
    aiperf_aggregate = property(lambda self: self.aiperf / self.AIPERF_AGGREGATE)
    vllm_bench = property(lambda self: self.path / self.VLLM_BENCH)
    vllm_bench_result = property(lambda self: self.vllm_bench / self.VLLM_BENCH_RESULT)
    vllm_bench_clock = property(lambda self: self.vllm_bench / self.VLLM_BENCH_CLOCK)
    start_at = property(lambda self: self.ready / self.START_AT)
    first_request = property(lambda self: self.ready / self.FIRST_REQUEST)
    first_tokens = property(lambda self: self.ready / self.FIRST_TOKENS)

    def log(self, name):
        """logs/<name>.log: one process's output."""
        return self.logs / f"{name}.log"

    def ready_file(self, name):
        """ready/<name>: written by an instance once it serves."""
        return self.ready / name

    def vllm_file(self, name):
        """vllm/<name>.json: engine vllm, one instance's server (workers/vllm_engine.py)."""
        return self.vllm / f"{name}.json"

    def vllm_log(self, name):
        """logs/<name>.vllm.log: that server's own output."""
        return self.logs / f"{name}.vllm.log"

    def control_file(self, name):
        """control/<name>.json: the runner's settings for one worker (the `slow` fault)."""
        return self.control / f"{name}.json"

    def status_file(self, name):
        """status/<name>.json: a worker's live state (workers/status.py, under --metrics)."""
        return self.status / f"{name}.json"

    def cache_pool(self, dc):
        return self.path / self.CACHE_POOL.format(dc=dc)

    def cache_pools(self):
        """cache_<dc>.json of each datacenter's prefix cache pool, by datacenter."""
        head, _, tail = self.CACHE_POOL.partition("{dc}")
        return {p.name[len(head):-len(tail)]: p
                for p in sorted(self.path.glob(self.CACHE_POOL.format(dc="*")))}


# ---------------------------------------------------------------- requests.jsonl

@dataclasses.dataclass(slots=True)     # slots: a million of them are read at once
class SentRecord:
    """A `sent` line: the client (or front door) handed request `id` to the scheduler."""

    id: int
    send_time: float | None
    scheduled: float | None
    lateness_s: float | None
    input_len: int | None = None        # the front door's: the request as it arrived
    output_len: int | None = None

    def line(self) -> dict:
        out = {"ev": "sent", **{f: getattr(self, f) for f in self.__slots__}}   # fields, in order
        if self.input_len is None:
            del out["input_len"], out["output_len"]
        return out


# Fields of a `done` line by who stamped them (clock correction, testbed/clocks.py).
CLIENT_FIELDS = ("send_time", "first_token", "last_token", "end_time")
PREFILL_FIELDS = ("prefill_queued", "prefill_start", "prefill_end", "send_start", "send_end")
DECODE_FIELDS = ("kv_recv_start", "kv_recv_end", "decode_join", "decode_held")
SCHEDULER_FIELDS = ("sched_received", "sched_routed")


@dataclasses.dataclass(slots=True)     # slots: 1.3 KB a record read, not 4.4 (docs/sim.md)
class RequestRecord:
    """A `done` line: one request's outcome and every stamp taken on its way (Unix seconds,
    each on the clock of the host that took it until `on_reference_clock`)."""

    id: int
    send_time: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    n_tokens: int = 0
    status: str = "failed"
    error: str = ""
    route: str | None = None
    decode_instance: str | None = None
    threshold: int | None = None
    kv_recv_start: float | None = None
    kv_recv_end: float | None = None
    kv_bytes: int | None = None
    decode_join: float | None = None
    kv_attempt: int | None = None
    attempts: int | None = None
    redispatches: list | None = None        # [{time, role, from, to, reason}]
    planned_cached_len: int | None = None
    cache_source: str | None = None
    prefix_transfer_bytes: int | None = None
    lookup_local: int | None = None
    lookup_prfaas: int | None = None
    decode_cached_len: int | None = None
    decode_cache_bytes: int | None = None
    prefill_instance: str | None = None
    prefill_queued: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    kv_bytes_sent: int | None = None
    send_start: float | None = None
    send_end: float | None = None
    overlap_s: float | None = None
    prefill_error: str | None = None
    cached_len: int | None = None
    cache_fetch_bytes: int | None = None
    cache_put_bytes: int | None = None
    cache_fetch_s: float | None = None
    # The TTFT decomposition's stamps and models (testbed/excess.py): the scheduler got the
    # request and dispatched it; the prefill's and the first decode step's modelled seconds;
    # when the decode batch first refused it for capacity.
    sched_received: float | None = None
    sched_routed: float | None = None
    prefill_model_s: float | None = None
    first_step_s: float | None = None
    decode_held: float | None = None
    end_time: float | None = None           # when the stream ended at the client
    token_times: list | None = None         # every token's decode stamp
    client_times: list | None = None        # every token's arrival at the client
    extra: dict = dataclasses.field(default_factory=dict)   # keys of other writers' lines

    def line(self, chunks=None) -> dict:
        """The JSON line; token times compact (testbed/tokentimes.py) when `chunks` is given
        (the client's [first token index, arrival] pairs)."""
        out = {"ev": "done"}
        for f in _RECORD_FIELDS:
            if f not in ("token_times", "client_times", "extra"):
                out[f] = getattr(self, f)
        if chunks is not None:
            out.update(tokentimes.compact(self.token_times or [], chunks))
        else:
            out.update(token_times=self.token_times, client_times=self.client_times)
        return out

    @classmethod
    def from_line(cls, obj: dict) -> RequestRecord:
        obj = tokentimes.expand(dict(obj))
        obj.pop("ev", None)
        known = {k: obj.pop(k) for k in list(obj) if k in _RECORD_FIELDS and k != "extra"}
        # A million records share a few names: one copy of each
        known.update((k, sys.intern(known[k])) for k in _SHARED if isinstance(known.get(k), str))
        return cls(**known, extra=dict(obj))    # a copy: the emptied dict keeps its size

    def columns(self) -> dict:
        """The request's fields for a table row (requests.parquet), id left out."""
        out = {f: getattr(self, f) for f in _RECORD_FIELDS if f not in ("id", "extra")}
        out.update(self.extra)
        return out

    def on_reference_clock(self, offsets: dict, client="client",
                           scheduler="scheduler") -> RequestRecord:
        """A copy with every stamp moved onto the orchestrator's clock by the offset of the
        instance that took it (`testbed.clocks.instance_offsets`)."""
        out = dataclasses.replace(self)
        c = offsets.get(client, 0.0)
        _shift(out, CLIENT_FIELDS, c)
        if isinstance(out.client_times, list):
            out.client_times = [t - c for t in out.client_times]
        _shift(out, PREFILL_FIELDS, offsets.get(out.prefill_instance, 0.0))
        d = offsets.get(out.decode_instance, 0.0)
        _shift(out, DECODE_FIELDS, d)
        if isinstance(out.token_times, list):
            out.token_times = [t - d for t in out.token_times]
        s = offsets.get(scheduler, 0.0)
        _shift(out, SCHEDULER_FIELDS, s)
        if out.redispatches:
            out.redispatches = [{**r, "time": r["time"] - s} if r.get("time") else r
                                for r in out.redispatches]
        return out


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_SHARED = ("status", "error", "route", "decode_instance", "prefill_instance", "cache_source")


def _shift(record, fields, offset):
    for f in fields:
        v = getattr(record, f)
        if isinstance(v, (int, float)) and v:
            setattr(record, f, v - offset)


def sent_from_line(obj: dict) -> SentRecord:
    return SentRecord(id=obj["id"], send_time=obj.get("send_time"), scheduled=obj.get("scheduled"),
                      lateness_s=obj.get("lateness_s"), input_len=obj.get("input_len"),
                      output_len=obj.get("output_len"))


def on_reference_clock(sent: SentRecord, offsets: dict, client="client") -> SentRecord:
    c = offsets.get(client, 0.0)
    return dataclasses.replace(sent, send_time=sent.send_time - c if sent.send_time else
                               sent.send_time)


class RecordLog:
    """Appends JSON lines (requests.jsonl, frontdoor.jsonl), one write each, line-buffered:
    a crash keeps every line written so far. `buffering`: the simulator's, which cannot crash
    half-way through a line, writes in large blocks."""

    def __init__(self, path, buffering=1):
        self.f = open(path, "a", buffering=buffering)

    def write(self, obj, chunks=None):
        """One line: a typed record (a `RequestRecord`'s token times compact when `chunks`, the
        client's [first token index, arrival] pairs, are given) or a dict (`all_sent`, ...)."""
        if isinstance(obj, RequestRecord):
            obj = obj.line(chunks)
        elif isinstance(obj, (SentRecord, DecisionRecord)):
            obj = obj.line()
        self.f.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def close(self):
        self.f.close()


def jsonl(path):
    """The objects of a JSONL file, lines cut by a crash skipped; none if it is missing."""
    p = pathlib.Path(path)
    if not p.exists():
        return
    for line in p.read_text(errors="replace").splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue


def read_records(path, clock=None) -> tuple[dict, dict]:
    """Latest `sent` and `done` line of each request id in requests.jsonl:
    ({id: SentRecord}, {id: RequestRecord}); lines cut by a crash are skipped. `clock`:
    metadata.json's `clocks`; every stamp is then put on the orchestrator's clock."""
    sent, done = {}, {}
    p = pathlib.Path(path)
    if not p.exists():
        return sent, done
    with open(p) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue            # a line cut by a crash
            ev = obj.get("ev")
            if ev == "sent":
                sent[obj["id"]] = sent_from_line(obj)
            elif ev == "done":
                done[obj["id"]] = RequestRecord.from_line(obj)
    offsets = clocks.instance_offsets(clock)
    if any(offsets.values()):
        sent = {k: on_reference_clock(s, offsets) for k, s in sent.items()}
        done = {k: r.on_reference_clock(offsets) for k, r in done.items()}
    return sent, done


def done_outcomes(lines):
    """Per `done` line among `lines` of requests.jsonl, whether it ended ok: a cheap look for
    the runner's progress bar while the client writes (no JSON parsing)."""
    return ['"status":"ok"' in line for line in lines if '"ev":"done"' in line]


def client_finished(run_dir) -> bool:
    """Whether the client wrote its `finished` record (it ended normally)."""
    path = RunDir(run_dir).records
    if not path.exists():
        return False
    with open(path, errors="replace") as f:
        return any('"ev":"finished"' in line for line in f)


# ---------------------------------------------------------------- decisions.jsonl

@dataclasses.dataclass
class DecisionRecord:
    """One routing decision (`workers.policy.Router.route`) and the book it read. The book is
    sparse so a line stays short on a large cluster: instances at zero are left out, and
    `roles` names only the instances whose list differs from runtime.json's role (a converted
    one, or "" while it drains and is in no list)."""

    id: int
    time: float                     # Unix seconds, the scheduler's clock (the sim's virtual)
    uncached_len: int               # the length the policy compared with the threshold
    policy: str
    threshold: int                  # in force at the decision
    outstanding_s: dict = dataclasses.field(default_factory=dict)   # prefill: predicted s
    inflight: dict = dataclasses.field(default_factory=dict)        # decode: requests
    down: list = dataclasses.field(default_factory=list)
    roles: dict = dataclasses.field(default_factory=dict)
    kind: str = ""                  # "remote" | "local"; "" when nothing was up
    prefill: str = ""
    decode: str = ""
    error: str = ""                 # the LookupError when nothing was up
    cache: dict = dataclasses.field(default_factory=dict)   # prefix cache: CachePlacer.plan

    def line(self) -> dict:
        # shallow: dataclasses.asdict deep-copies the book, 8x the cost of the whole line
        return {"ev": "route", **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_line(cls, obj: dict) -> DecisionRecord:
        return cls(**{k: v for k, v in obj.items() if k != "ev"})


def read_decisions(path) -> list[DecisionRecord]:
    """decisions.jsonl's records in the order they were made (a line cut by a crash skipped)."""
    return [DecisionRecord.from_line(o) for o in jsonl(path) if o.get("ev") == "route"]


# ---------------------------------------------------------------- events.csv

class EventLog:
    """Callable: `events(kind, **fields)` appends a row (time, kind, detail) to events.csv.

    The file is opened for appending (O_APPEND) and each row is one write, so other processes
    of the run (the scheduler's health transitions, the decode workers' discarded KV) append
    their rows to the same file with `EventLog(path, fresh=False)`; readers sort by time.
    """

    def __init__(self, path, fresh=True, by=None, clock=time.time):
        """`by`: the instance writing (a worker), added to every row as `by=<name>`, so
        analysis puts its times on the orchestrator's clock (testbed/clocks.py); `clock`: what
        stamps the rows (the simulator's virtual Unix time)."""
        self.by, self.clock = by, clock
        if fresh:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(["time", "kind", "detail"])
        self.f = open(path, "a", newline="", buffering=1)
        self.w = csv.writer(self.f)
        self.lock = threading.Lock()

    def __call__(self, kind, **fields):
        if self.by is not None:
            fields = {**fields, "by": self.by}
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        with self.lock:
            if not self.f.closed:
                self.w.writerow([f"{self.clock():.6f}", kind, detail])

    def close(self):
        with self.lock:
            self.f.close()


class Event(tuple):
    """One events.csv row: (time, kind, {key: value}); `detail` is the row's text as written."""

    def __new__(cls, t, kind, fields, detail=""):
        self = super().__new__(cls, (t, kind, fields))
        self.detail = detail
        return self

    time = property(lambda self: self[0])
    kind = property(lambda self: self[1])
    fields = property(lambda self: self[2])


def read_events(path, clock=None) -> list[Event]:
    """events.csv as a list of `Event`s, sorted by time (several processes append to it).
    `clock`: metadata.json's `clocks`; rows a worker wrote (`by=<instance>`) then have their
    time on the orchestrator's clock (`testbed.clocks.event_time`)."""
    offsets = clocks.instance_offsets(clock)
    out = []
    p = pathlib.Path(path)
    if not p.exists():
        return out
    with open(p, newline="", errors="replace") as f:
        for row in csv.DictReader(f):
            try:
                t = float(row["time"])
            except (TypeError, ValueError):
                continue
            detail = row.get("detail") or ""
            fields = dict(kv.partition("=")[::2] for kv in detail.split(" ") if "=" in kv)
            out.append(Event(clocks.event_time(t, fields, offsets), row["kind"], fields, detail))
    return sorted(out, key=lambda e: e[0])
