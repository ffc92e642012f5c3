"""Failure injection: the experiment's `faults:` list, checked before anything is built, and the
injector that carries it out during the run.

Kinds (all times real-world, after the first arrival; `testbed.deploy` puts them on the
emulated clock with the rest of the schedule):

- `pause`: SIGSTOP the target's worker process, SIGCONT after `duration` (a gray failure: the
  process keeps its sockets open and answers nothing).
- `kill`: SIGKILL, stays dead.
- `restart`: SIGKILL, then start the worker again `after` later; it rejoins when the scheduler's
  health check hears from it.
- `link`: change the WAN (`direction` kv | request | both; any of `rate`, `delay`, `loss`, `up`)
  for `duration` (none: for good), through the same `LinkSchedule` and shaper as
  `network.wan.changes`; at the end the values in force before the fault (the configured link
  and any `changes` before it) come back. A link fault and a `changes` entry that set the same
  key of the same direction while the fault lasts contradict each other: exit 2.
- `slow`: the target's engine runs its clock `factor` times slower for `duration` (the profile
  engine's own clock: prefills and decode steps take factor x their profiled time; a real
  slowdown of that one instance, nothing else on the machine is touched). The runner writes
  `control/<name>.json` in the run directory and sends SIGUSR1; the worker reads it.

Targets: an instance name (`rp0`, `lp1`, `ld0`), a cluster (`prfaas`, `local`), a role
(`prefill`, `decode`): every instance in it at once; or `random(X)` (X one of those groups): one
instance, drawn with the experiment's seed, for each occurrence. `every`/`count` repeat a fault:
occurrences at `at`, `at + every`, ... (`at` defaults to `every`).
"""

import dataclasses
import json
import math
import pathlib
import random
import signal
import threading
import time

from testbed import units
from testbed.errors import ConfigError
from testbed.scale import Scale
from testbed.schema import choice, integer, optional, positive, spec, string

KINDS = ("pause", "kill", "restart", "link", "slow")
LINK_KEYS = ("rate", "delay", "loss", "up")
GROUPS = ("prfaas", "local", "prefill", "decode")


def _up(value):
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One injected failure (list item of `faults:`)."""

    kind: str = spec(choice(*KINDS), doc="pause | kill | restart | link | slow")
    at: float = spec(optional(units.duration_s), None,
                     "when (real-world, after the first arrival), e.g. 30s")
    every: float = spec(optional(positive(units.duration_s)), None,
                        "repeat with this period (first at `at`, default `every`)")
    count: int = spec(optional(integer(1, 10000)), None, "with `every`: number of occurrences")
    target: str = spec(optional(string), None,
                       "instance (rp0, lp1, ld0), cluster (prfaas, local), role (prefill, "
                       "decode) or random(GROUP); not for link")
    duration: float = spec(optional(positive(units.duration_s)), None,
                           "pause, slow: how long; link: how long (none: for good)")
    after: float = spec(optional(positive(units.duration_s)), None,
                        "restart: start the worker again this long after the kill")
    factor: float = spec(optional(positive(units.number)), None,
                         "slow: the engine's clock runs this many times slower (> 1)")
    direction: str = spec(choice("kv", "request", "both"), "both", "link: which direction")
    rate: float = spec(optional(units.rate_bps), None, "link: rate while it lasts")
    delay: float = spec(optional(units.duration_s), None, "link: one-way delay while it lasts")
    loss: float = spec(optional(units.probability), None, "link: loss probability while it lasts")
    up: bool = spec(optional(_up), None, "link: false cuts the link while it lasts")

    def check(self):
        k = self.kind
        if self.at is None and self.every is None:
            raise ValueError("a fault needs 'at' or 'every'")
        if self.count is not None and self.every is None:
            raise ValueError("'count' needs 'every'")
        if self.every is not None and self.count is None:
            raise ValueError("'every' needs 'count'")
        allowed = {"pause": {"target", "duration"}, "kill": {"target"},
                   "restart": {"target", "after"}, "slow": {"target", "duration", "factor"},
                   "link": {"duration", "direction", *LINK_KEYS}}[k]
        for key in ("target", "duration", "after", "factor", *LINK_KEYS):
            if getattr(self, key) is not None and key not in allowed:
                raise ValueError(f"kind {k} takes no '{key}' (it takes "
                                 f"{', '.join(sorted(allowed))})")
        if self.direction != "both" and k != "link":
            raise ValueError(f"kind {k} takes no 'direction'")
        if k != "link" and self.target is None:
            raise ValueError(f"kind {k} needs 'target'")
        if k in ("pause", "slow") and self.duration is None:
            raise ValueError(f"kind {k} needs 'duration'")
        if k == "restart" and self.after is None:
            raise ValueError("kind restart needs 'after'")
        if k == "slow" and (self.factor is None or self.factor <= 1):
            raise ValueError("kind slow needs 'factor' > 1")
        if k == "link" and all(getattr(self, x) is None for x in LINK_KEYS):
            raise ValueError(f"kind link needs at least one of {', '.join(LINK_KEYS)}")

    def times(self):
        """Real-world injection times of every occurrence."""
        if self.every is None:
            return [self.at]
        first = self.every if self.at is None else self.at
        return [first + k * self.every for k in range(self.count)]


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """One injection: YAML index, occurrence number, resolved target instances, real-world times."""

    index: int
    n: int
    spec: FaultSpec
    targets: tuple          # instance names; () for link
    at_s: float
    end_s: float            # real-world end (SIGCONT, restart, link restored); inf: never

    @property
    def target(self):
        return ",".join(self.targets) if self.targets else f"wan:{self.spec.direction}"

    def as_dict(self):
        return {"index": self.index, "occurrence": self.n, "kind": self.spec.kind,
                "target": self.target, "at_s": self.at_s,
                "end_s": None if math.isinf(self.end_s) else self.end_s}


def instance_names(exp):
    """The instances a fault may target (prefill and decode), as the deployment names them."""
    from testbed import deploy
    return deploy.instance_names(exp)


def _group(name, names):
    if name == "prfaas":
        return [n for n in names if n.startswith("rp")]
    if name == "local":
        return [n for n in names if n.startswith(("lp", "ld"))]
    if name == "prefill":
        return [n for n in names if n.startswith(("rp", "lp"))]
    if name == "decode":
        return [n for n in names if n.startswith("ld")]
    return [name] if name in names else None


def _resolve_target(text, names, rng):
    """Instance names a target string stands for; raises ValueError naming what was expected."""
    t = text.strip()
    pick = t.startswith("random(") and t.endswith(")")
    group = _group(t[7:-1].strip() if pick else t, names)
    if not group:
        raise ValueError(f"unknown target {text!r}; expected an instance ({', '.join(names)}), "
                         f"{', '.join(GROUPS)} or random(GROUP), with at least one instance")
    return (rng.choice(group),) if pick else tuple(group)


def expected_end_s(exp):
    """Real-world time of the last arrival of the request list the run will send (the same
    seeded generator), or `duration` when that is longer."""
    from testbed.workload import generate
    wl = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration)
    last = float(wl.arrival_s.max()) if len(wl) else 0.0
    return max(last, exp.duration or 0.0)


def resolve(exp):
    """Every occurrence of every fault, YAML order; raises ValueError(key, message) on bad specs."""
    names = instance_names(exp)
    rng = random.Random(exp.seed)
    out = []
    for i, f in enumerate(exp.faults):
        for n, at in enumerate(f.times()):
            try:
                targets = () if f.kind == "link" else _resolve_target(f.target, names, rng)
            except ValueError as e:
                raise _Bad(f"faults[{i}].target", str(e)) from None
            if f.kind == "kill":
                end = math.inf
            elif f.kind == "restart":
                end = at + f.after
            else:
                end = at + f.duration if f.duration is not None else math.inf
            out.append(Occurrence(i, n, f, targets, at, end))
    return out


class _Bad(Exception):
    def __init__(self, key, message):
        super().__init__(message)
        self.key = key


def _span(o):
    end = "for good" if math.isinf(o.end_s) else f"until {o.end_s:g}s"
    return f"{o.spec.kind} at {o.at_s:g}s {end}"


def _check_overlaps(occ, exp):
    by_target = {}
    for o in occ:
        for t in o.targets:
            by_target.setdefault(t, []).append(o)
    for t, lst in by_target.items():
        lst = sorted(lst, key=lambda o: o.at_s)
        for a, b in zip(lst, lst[1:]):
            if b.at_s < a.end_s or b.at_s == a.at_s:
                if a.spec.kind == "kill" and b.spec.kind == "restart":
                    raise _Bad(f"faults[{b.index}]", f"restart of {t} at {b.at_s:g}s, already "
                               f"killed for good by faults[{a.index}] at {a.at_s:g}s")
                raise _Bad(f"faults[{b.index}]", f"{_span(b)} on {t} overlaps faults[{a.index}] "
                           f"({_span(a)}) on the same instance")
    links = [o for o in occ if o.spec.kind == "link"]
    dirs = lambda d: ("kv", "request") if d == "both" else (d,)   # noqa: E731
    for x in range(len(links)):
        a = links[x]
        for b in links[x + 1:]:
            keys = {k for k in LINK_KEYS if getattr(a.spec, k) is not None
                    and getattr(b.spec, k) is not None}
            if keys and set(dirs(a.spec.direction)) & set(dirs(b.spec.direction)) and \
                    max(a.at_s, b.at_s) < min(a.end_s, b.end_s):
                first, second = sorted((a, b), key=lambda o: (o.at_s, o.index))
                raise _Bad(f"faults[{second.index}]",
                           f"link fault at {second.at_s:g}s sets {', '.join(sorted(keys))} of "
                           f"the same direction as faults[{first.index}] ({_span(first)})")
        for j, c in enumerate(exp.network.wan.changes):
            keys = {k for k in LINK_KEYS if getattr(a.spec, k) is not None
                    and getattr(c, k, None) is not None}
            if keys and set(dirs(a.spec.direction)) & set(dirs(c.direction)) and \
                    a.at_s <= c.at < a.end_s:
                raise _Bad(f"faults[{a.index}]",
                           f"link fault ({_span(a)}) and network.wan.changes[{j}] at {c.at:g}s "
                           f"both set {', '.join(sorted(keys))} of the same direction")


def check(exp, path=None):
    """Raise ConfigError (exit 2, one line) for a fault list that cannot be carried out."""
    if not exp.faults:
        return []
    try:
        occ = resolve(exp)
        end = expected_end_s(exp)
        for o in occ:
            if o.at_s > end:
                raise _Bad(f"faults[{o.index}].at", f"{o.spec.kind} at {o.at_s:g}s is past the "
                           f"run's expected end ({end:g}s, the last arrival)")
            if o.spec.kind == "slow" and exp.model.engine != "profile":
                raise _Bad(f"faults[{o.index}].kind", "slow needs model.engine profile (the "
                           "profile engine's clock is what it slows)")
        _check_overlaps(occ, exp)
    except _Bad as e:
        raise ConfigError(str(e), path=path, key=e.key) from None
    return occ


# ---- during the run ----

class Injector:
    """Carries out the instance faults (pause, kill, restart, slow) at their times, in a thread.

    `procs()` returns the run's {name: Popen}; `respawn(name)` starts a worker again; `events`
    is the run's EventLog. Every injection and its end are logged (`fault_inject`, `fault_end`).
    `stop()` resumes anything still paused and restores clocks, so teardown finds live processes.
    """

    def __init__(self, actions, run_dir, procs, respawn, events):
        self.dir = pathlib.Path(run_dir)
        self.procs, self.respawn, self.events = procs, respawn, events
        self.actions = list(actions)        # deploy.FaultAction, emulated seconds, in order
        self.paused = set()
        self._stop = threading.Event()
        self._thread = None
        self.error = None

    def start(self, t0):
        if self.actions:
            self._thread = threading.Thread(target=self._run, args=(t0,), daemon=True,
                                            name="faults")
            self._thread.start()
        return self

    def _run(self, t0):
        for a in self.actions:
            if self._stop.wait(max(0.0, t0 + a.at_s - time.time())):
                return
            try:
                # Logged as it starts: what it causes (a health transition) comes after.
                self.events(f"fault_{a.phase}", fault=a.fault, occurrence=a.occurrence,
                            fault_kind=a.kind, target=a.target)
                for name in a.targets:
                    self._do(a, name)
            except Exception as e:  # keep measuring; say what failed
                self.error = e
                self.events("fault_error", fault=a.fault, error=f"{type(e).__name__}: {e}")

    def _signal(self, name, sig):
        p = self.procs().get(name)
        if p is not None and p.poll() is None:
            p.send_signal(sig)      # a Popen or a backend's handle (another host's process)

    def _do(self, a, name):
        k, phase = a.kind, a.phase
        if k == "pause":
            if phase == "inject":
                self._signal(name, signal.SIGSTOP)
                self.paused.add(name)
            else:
                self._signal(name, signal.SIGCONT)
                self.paused.discard(name)
        elif k in ("kill", "restart") and phase == "inject":
            p = self.procs().get(name)
            self._signal(name, signal.SIGKILL)
            if p is not None:
                p.wait(timeout=5)
        elif k == "restart":
            self.respawn(name)
        elif k == "slow":
            self.set_clock(name, a.factor if phase == "inject" else 1.0)

    def set_clock(self, name, factor):
        """The worker's engine clock factor, through control/<name>.json and SIGUSR1."""
        d = self.dir / "control"
        d.mkdir(exist_ok=True)
        tmp = d / f".{name}.json"
        tmp.write_text(json.dumps({"clock_factor": factor}))
        tmp.replace(d / f"{name}.json")
        self._signal(name, signal.SIGUSR1)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for name in list(self.paused):
            try:
                self._signal(name, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.paused.clear()


# ---- after the run: accounting and per-fault recovery metrics (summary.json) ----

# Errors the analysis itself gives a request that has no reply from the system: lost, not failed.
LOST_ERRORS = ("no reply recorded before the run ended", "never sent (the run ended first)",
               "run ended before the request finished")


def read_events(path, clock=None):
    """events.csv as a list of (time, kind, {key: value}), sorted by time (several processes
    append to it). `clock`: metadata.json's `clocks`; rows a worker wrote (`by=<instance>`)
    then have their time on the orchestrator's clock (`testbed.clocks.event_time`)."""
    import csv

    from testbed import clocks
    offsets = clocks.instance_offsets(clock)
    out = []
    p = pathlib.Path(path)
    if not p.exists():
        return out
    with open(p, newline="") as f:
        for row in csv.DictReader(f):
            try:
                t = float(row["time"])
            except (TypeError, ValueError):
                continue
            fields = dict(kv.partition("=")[::2] for kv in (row.get("detail") or "").split(" ")
                          if "=" in kv)
            out.append((clocks.event_time(t, fields, offsets), row["kind"], fields))
    return sorted(out, key=lambda e: e[0])


def accounting(df):
    """sent / completed / failed (a reply with a reason) / lost (no reply from the system)."""
    has_send = df.send_time.notna() if "send_time" in df else df.status.isna()
    lost = df.error.isin(LOST_ERRORS) & (df.status != "ok")
    ok = df.status == "ok"
    return {"requests": int(len(df)), "sent": int(has_send.sum()), "completed": int(ok.sum()),
            "failed": int((~ok & ~lost).sum()), "lost": int(lost.sum())}


def _rolling_recovery(df, at_emul, pre_level, window_s, scale, t0):
    """Real-world seconds from injection until the TTFT p90 of the arrivals in a window of
    `window_s` (real-world) starting at or after the injection is back within 10% of
    `pre_level` (failed requests count as infinite TTFT); None if it never is."""
    import numpy as np
    if pre_level is None or not np.isfinite(pre_level):
        return None
    arr = scale.real_s(df.send_time - t0).to_numpy()
    ttft = np.where(df.status == "ok", df.ttft_ms, np.inf)
    at = scale.real_s(at_emul - t0)
    last = np.nanmax(arr) if len(arr) else at
    start = at
    while start + window_s <= last + 1e-9:
        sel = (arr >= start) & (arr < start + window_s)
        if sel.sum() >= 3 and np.percentile(ttft[sel], 90) <= 1.1 * pre_level:
            return float(start + window_s - at)
        start += window_s / 4
    return None


def analyse(run_dir, exp, df, scale: Scale):
    """`accounting`, `faults` (one entry per injection, YAML order) and the KV duplicates the
    decode workers discarded, from requests (df), events.csv and the run's metadata; `scale`:
    the run's, from its directory (`testbed.rundir.scale`)."""
    import numpy as np
    d = pathlib.Path(run_dir)
    out = {"accounting": accounting(df)}
    meta = json.loads((d / "metadata.json").read_text()) if (d / "metadata.json").exists() else {}
    events = read_events(d / "events.csv", meta.get("clocks"))
    discarded = [f for _, k, f in events if k == "kv_discarded"]
    out["kv_discarded"] = {"attempts": len(discarded),
                           "duplicates": sum(f.get("complete") == "1" for f in discarded),
                           "bytes": sum(int(f.get("bytes", 0)) for f in discarded)}
    redispatches = [(r["time"], rid, r) for rid, lst in zip(df.id, df.get(
        "redispatches", [None] * len(df))) if isinstance(lst, (list, np.ndarray))
        for r in lst]
    out["redispatched_requests"] = len({rid for _, rid, _ in redispatches})
    if not exp.faults:
        return out
    t0 = meta.get("client_start_at", df.send_time.min())
    fo = exp.scheduler.failover
    window = 2 * (fo.interval + fo.timeout) if fo.enabled else None   # two missed checks
    out["detection_window_s"] = window
    injected = {(int(f["fault"]), int(f["occurrence"])): t for t, k, f in events
                if k == "fault_inject" and "fault" in f}
    ended = {(int(f["fault"]), int(f["occurrence"])): t for t, k, f in events
             if k == "fault_end" and "fault" in f}
    downs = [(t, f.get("instance")) for t, k, f in events
             if k == "health" and f.get("state") == "down"]
    by_id = df.set_index("id")
    uncached = by_id.input_len - by_id.get("cached_len", 0)
    end_time = df.end_time if "end_time" in df else df.last_token
    rows = []
    for o in resolve(exp):
        key = (o.index, o.n)
        t_inj = injected.get(key)
        entry = {"kind": o.spec.kind, "target": o.target, "at_s": o.at_s, "detect_s": None,
                 "recover_s": None, "requests_affected": 0, "redispatched": 0, "failed": 0,
                 "wasted_prefill_tokens": 0}
        if t_inj is None:
            entry["error"] = "not injected (see events.csv)"
            rows.append(entry)
            continue
        entry["at_s"] = scale.real_s(t_inj - t0)
        t_end = ended.get(key, math.inf)
        if o.spec.kind == "link":
            targets = {f"rp{i}" for i in range(exp.clusters.prfaas.instances)}
        else:
            targets = set(o.targets)
        det = [t for t, inst in downs if inst in targets and t >= t_inj and
               (math.isinf(t_end) or t <= t_end + scale.emulated_s(10.0))]
        if det:
            entry["detect_s"] = scale.real_s(det[0] - t_inj)
        moved = [(t, rid, r) for t, rid, r in redispatches
                 if r["from"] in targets and t >= t_inj and
                 (math.isinf(t_end) or t <= t_end + scale.emulated_s(window or 0) + 1.0)]
        moved_ids = {rid for _, rid, _ in moved}
        on_target = df.prefill_instance.isin(targets) | df.decode_instance.isin(targets) | \
            df.id.isin(moved_ids)
        if o.spec.kind == "link":
            on_target |= df.route == "remote"
        alive = (df.send_time <= t_end) & (end_time.fillna(np.inf) >= t_inj)
        aff = df[on_target & alive]
        entry["requests_affected"] = int(len(aff))
        entry["redispatched"] = len(moved)
        entry["failed"] = int((aff.status != "ok").sum())
        if moved:
            entry["redispatch_max_s"] = scale.real_s(max(t - t_inj for t, _, _ in moved))
        wasted = 0.0
        aff_ids = set(aff.id)
        for f in discarded:
            rid = int(f.get("id", -1))
            if rid not in aff_ids:
                continue
            full = float(uncached.get(rid, 0))
            if f.get("complete") == "1":
                wasted += full
            else:
                kvb = by_id.kv_bytes.get(rid)
                if kvb and np.isfinite(kvb) and kvb > 0:
                    wasted += full * min(1.0, int(f["bytes"]) / kvb)
        entry["wasted_prefill_tokens"] = int(round(wasted))
        pre = df[(df.send_time < t_inj) & (df.status == "ok")]
        pre = pre[pre.send_time >= t_inj - scale.emulated_s(60.0)]            # the minute before it
        level = float(np.percentile(pre.ttft_ms, 90)) if len(pre) >= 3 else None
        entry["pre_p90_ttft_ms"] = level
        entry["recover_s"] = _rolling_recovery(df, t_inj, level, 10.0, scale, t0)
        if entry["recover_s"] is not None:
            entry["recover_s"] = round(entry["recover_s"], 3)
        rows.append(entry)
    out["faults"] = rows
    return out


MATRIX_COLUMNS = ["label", "case", "fault", "policy", "failover", "completed", "failed", "lost",
                  "p90_ttft_ms", "baseline_p90_ttft_ms", "p90_inflation", "detect_s",
                  "recover_s", "redispatched", "wasted_prefill_tokens"]


def write_matrix(top, runs, summaries):
    """failure_matrix.csv and .md in the top directory of an experiment whose variants inject
    faults: one row per run; p90 TTFT inflation against the run without faults (fault `none`)
    of the same policy and failover setting."""
    import pandas as pd
    rows = []
    for exp, s in zip(runs, summaries):
        fs = s.get("faults") or []
        rows.append({
            "label": exp.label, "case": exp.label.split(",")[0],    # the variant's own label
            "fault": "+".join(dict.fromkeys(f.kind for f in exp.faults)) or "none",
            "policy": exp.scheduler.policy, "failover": exp.scheduler.failover.enabled,
            "completed": s["accounting"]["completed"], "failed": s["accounting"]["failed"],
            "lost": s["accounting"]["lost"], "p90_ttft_ms": s.get("p90_ttft_ms"),
            "detect_s": next((f["detect_s"] for f in fs if f.get("detect_s") is not None), None),
            "recover_s": next((f["recover_s"] for f in fs if f.get("recover_s") is not None),
                              None),
            "redispatched": sum(f.get("redispatched", 0) for f in fs),
            "wasted_prefill_tokens": sum(f.get("wasted_prefill_tokens", 0) for f in fs)})
    m = pd.DataFrame(rows)
    base = m[m.fault == "none"].set_index(["policy", "failover"]).p90_ttft_ms
    m["baseline_p90_ttft_ms"] = [base.get((p, f)) for p, f in zip(m.policy, m.failover)]
    m["p90_inflation"] = m.p90_ttft_ms / m.baseline_p90_ttft_ms
    m = m[MATRIX_COLUMNS]
    top = pathlib.Path(top)
    m.to_csv(top / "failure_matrix.csv", index=False)
    fmt = {"p90_ttft_ms": "{:.0f}", "baseline_p90_ttft_ms": "{:.0f}", "p90_inflation": "{:.2f}",
           "detect_s": "{:.1f}", "recover_s": "{:.1f}"}
    lines = ["| " + " | ".join(MATRIX_COLUMNS) + " |", "|" + "---|" * len(MATRIX_COLUMNS)]
    for r in m.itertuples(index=False):
        cells = []
        for c, v in zip(MATRIX_COLUMNS, r):
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("-")
            else:
                cells.append(fmt.get(c, "{}").format(v))
        lines.append("| " + " | ".join(cells) + " |")
    (top / "failure_matrix.md").write_text("\n".join(lines) + "\n")
    return m
