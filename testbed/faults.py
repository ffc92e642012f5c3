"""Failure injection, analysed: accounting (sent, completed, failed, lost) and, per injected
fault, detection, re-dispatch, wasted prefill and recovery (summary.json), and the failure
matrix of an experiment whose variants inject faults.

Place in the architecture: the analysis floor (`testbed.analysis` calls it). It reads the
run directory only: the injections as events.csv logged them (`testbed.records.read_events`,
on the orchestrator's clock) and the occurrences resolved against the instances of the run's
runtime.json (`testbed.faultspec.resolve`).
"""

import math

import numpy as np
import pandas as pd

from testbed import rundir
from testbed.faultspec import WAN_KINDS, resolve, targetable
from testbed.records import RunDir, read_events
from testbed.runtime import InstanceRuntime
from testbed.scale import Scale


# Errors the analysis itself gives a request that has no reply from the system: lost, not failed.
LOST_ERRORS = ("no reply recorded before the run ended", "never sent (the run ended first)",
               "run ended before the request finished")


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


def _kv_discarded(discarded):
    return {"attempts": len(discarded),
            "duplicates": sum(f.get("complete") == "1" for f in discarded),
            "bytes": sum(int(f.get("bytes", 0)) for f in discarded)}


def _redispatches(df):
    """(time, request id, re-dispatch) of every re-dispatch the records hold."""
    return [(r["time"], rid, r) for rid, lst in zip(df.id, df.get(
        "redispatches", [None] * len(df))) if isinstance(lst, (list, np.ndarray))
        for r in lst]


def instances(rd):
    """The run's instances (runtime.json, in the deployment's order): what faults targeted."""
    rt = rundir.runtime(rd) or {}
    return [InstanceRuntime(name=n, **{k: v for k, v in i.items() if k != "name"})
            for n, i in (rt.get("instances") or {}).items()]


class _Injections:
    """What one run's events.csv and records say about its injections (orchestrator's clock)."""

    def __init__(self, df, events, discarded, exp, scale, instances):
        self.df, self.scale = df, scale
        # a link fault affects what crosses the WAN: every PrfaaS instance's requests
        self.prfaas = {i.name for i in targetable(instances) if i.dc == "prfaas"}
        self.discarded = discarded
        self.injected = {(int(f["fault"]), int(f["occurrence"])): t for t, k, f in events
                         if k == "fault_inject" and "fault" in f}
        self.ended = {(int(f["fault"]), int(f["occurrence"])): t for t, k, f in events
                      if k == "fault_end" and "fault" in f}
        self.downs = [(t, f.get("instance")) for t, k, f in events
                      if k == "health" and f.get("state") == "down"]
        self.redispatches = _redispatches(df)
        self.by_id = df.set_index("id")
        self.uncached = self.by_id.input_len - self.by_id.get("cached_len", 0)
        self.end_time = df.end_time if "end_time" in df else df.last_token
        fo = exp.scheduler.failover
        self.window = 2 * (fo.interval + fo.timeout) if fo.enabled else None  # 2 missed checks

    def entry(self, o, t0):
        """One occurrence's summary entry."""
        scale = self.scale
        entry = {"kind": o.spec.kind, "target": o.target, "at_s": o.at_s, "detect_s": None,
                 "recover_s": None, "requests_affected": 0, "redispatched": 0, "failed": 0,
                 "wasted_prefill_tokens": 0}
        t_inj = self.injected.get((o.index, o.n))
        if t_inj is None:
            entry["error"] = "not injected (see events.csv)"
            return entry
        entry["at_s"] = scale.real_s(t_inj - t0)
        t_end = self.ended.get((o.index, o.n), math.inf)
        if o.spec.kind in WAN_KINDS:
            targets = self.prfaas
        else:
            targets = set(o.targets)
        det = [t for t, inst in self.downs if inst in targets and t >= t_inj and
               (math.isinf(t_end) or t <= t_end + scale.emulated_s(10.0))]
        if det:
            entry["detect_s"] = scale.real_s(det[0] - t_inj)
        aff, moved = self._affected(o, targets, t_inj, t_end)
        entry["requests_affected"] = int(len(aff))
        entry["redispatched"] = len(moved)
        entry["failed"] = int((aff.status != "ok").sum())
        if moved:
            entry["redispatch_max_s"] = scale.real_s(max(t - t_inj for t, _, _ in moved))
        entry["wasted_prefill_tokens"] = int(round(self._wasted(set(aff.id))))
        entry.update(self._recovery(t_inj, t0))
        if not math.isinf(t_end):
            entry.update(self._after_end(t_end, t0))
        return entry

    def _after_end(self, t_end, t0):
        """After the fault ended: the longest any request sent before the end stayed unfinished
        past it (real-world s; `hung`: those never finished), and how soon success returned (the
        first request sent after the end that completed, real-world s after the end)."""
        df, scale = self.df, self.scale
        left = self.end_time.fillna(np.inf)[df.send_time < t_end] - t_end
        finite = left[np.isfinite(left)]
        after = df[df.send_time >= t_end].sort_values("send_time")
        ok = after[after.status == "ok"]
        return {"end_s": round(scale.real_s(t_end - t0), 3), "hung": int((~np.isfinite(left)).sum()),
                "unfinished_after_end_s": round(scale.real_s(max(0.0, float(finite.max()))), 3)
                if len(finite) else 0.0,
                "success_after_end_s": round(scale.real_s(float(ok.send_time.iloc[0]) - t_end), 3)
                if len(ok) else None,
                "failed_after_end": int((after.status != "ok").sum())}

    def _affected(self, o, targets, t_inj, t_end):
        """The requests on the targets while the fault lasted, and the re-dispatches off them."""
        df, scale = self.df, self.scale
        moved = [(t, rid, r) for t, rid, r in self.redispatches
                 if r["from"] in targets and t >= t_inj and
                 (math.isinf(t_end) or t <= t_end + scale.emulated_s(self.window or 0) + 1.0)]
        moved_ids = {rid for _, rid, _ in moved}
        on_target = df.prefill_instance.isin(targets) | df.decode_instance.isin(targets) | \
            df.id.isin(moved_ids)
        if o.spec.kind in WAN_KINDS:
            on_target |= df.route == "remote"
        alive = (df.send_time <= t_end) & (self.end_time.fillna(np.inf) >= t_inj)
        return df[on_target & alive], moved

    def _wasted(self, aff_ids):
        """Prefill tokens whose KV the decode workers discarded, of the affected requests."""
        wasted = 0.0
        for f in self.discarded:
            rid = int(f.get("id", -1))
            if rid not in aff_ids:
                continue
            full = float(self.uncached.get(rid, 0))
            if f.get("complete") == "1":
                wasted += full
            else:
                kvb = self.by_id.kv_bytes.get(rid)
                if kvb and np.isfinite(kvb) and kvb > 0:
                    wasted += full * min(1.0, int(f["bytes"]) / kvb)
        return wasted

    def _recovery(self, t_inj, t0):
        df, scale = self.df, self.scale
        pre = df[(df.send_time < t_inj) & (df.status == "ok")]
        pre = pre[pre.send_time >= t_inj - scale.emulated_s(60.0)]       # the minute before it
        level = float(np.percentile(pre.ttft_ms, 90)) if len(pre) >= 3 else None
        rec = _rolling_recovery(df, t_inj, level, 10.0, scale, t0)
        return {"pre_p90_ttft_ms": level,
                "recover_s": round(rec, 3) if rec is not None else None}


def analyse(run_dir, exp, df, scale: Scale):
    """`accounting`, `faults` (one entry per injection, YAML order) and the KV duplicates the
    decode workers discarded, from requests (df), events.csv and the run's metadata; `scale`:
    the run's, from its directory (`testbed.rundir.scale`)."""
    rd = RunDir(run_dir)
    out = {"accounting": accounting(df)}
    meta = rundir.metadata(rd)
    events = read_events(rd.events, meta.get("clocks"))
    discarded = [f for _, k, f in events if k == "kv_discarded"]
    out["kv_discarded"] = _kv_discarded(discarded)
    out["redispatched_requests"] = len({rid for _, rid, _ in _redispatches(df)})
    # KV transfers a prefill worker sent again on a new connection (workers/prefill.py), and
    # prefill attempts beyond a request's first (each re-dispatch prefills it again)
    out["kv_retries"] = sum(k == "kv_retry" for _, k, _ in events)
    out["kv_reprefills"] = len(_redispatches(df))
    # decode streams opened again at their KV deadline while the prefill still ran (failover)
    out["kv_deadline_waits"] = sum(k == "kv_wait" for _, k, _ in events)
    if not exp.faults:
        return out
    t0 = meta.get("client_start_at", df.send_time.min())
    deployed = instances(rd)
    inj = _Injections(df, events, discarded, exp, scale, deployed)
    out["detection_window_s"] = inj.window
    out["faults"] = [inj.entry(o, t0) for o in resolve(exp, deployed)]
    return out


MATRIX_COLUMNS = ["label", "case", "fault", "policy", "failover", "completed", "failed", "lost",
                  "p90_ttft_ms", "baseline_p90_ttft_ms", "p90_inflation", "detect_s",
                  "recover_s", "redispatched", "wasted_prefill_tokens"]
# the conformance view (issue 24): nothing lost or hung, how long the fault's effect lasted
CONFORMANCE_COLUMNS = ["case", "policy", "failover", "completed", "failed", "lost", "hung",
                       "unfinished_after_end_s", "p90_ttft_ms", "p90_inflation", "kv_retries",
                       "kv_reprefills", "success_after_end_s", "failed_after_end"]
FORMATS = {"p90_ttft_ms": "{:.0f}", "baseline_p90_ttft_ms": "{:.0f}", "p90_inflation": "{:.2f}",
           "detect_s": "{:.1f}", "recover_s": "{:.1f}", "unfinished_after_end_s": "{:.1f}",
           "success_after_end_s": "{:.1f}", "failed_after_end": "{:.0f}"}


def _first(fs, key):
    return next((f[key] for f in fs if f.get(key) is not None), None)


def _matrix_row(exp, s):
    fs = s.get("faults") or []
    ends = [f for f in fs if "unfinished_after_end_s" in f]
    return {
        "label": exp.label, "case": exp.label.split(",")[0],    # the variant's own label
        "fault": "+".join(dict.fromkeys(f.kind for f in exp.faults)) or "none",
        "policy": exp.scheduler.policy, "failover": exp.scheduler.failover.enabled,
        "completed": s["accounting"]["completed"], "failed": s["accounting"]["failed"],
        "lost": s["accounting"]["lost"], "p90_ttft_ms": s.get("p90_ttft_ms"),
        "detect_s": _first(fs, "detect_s"), "recover_s": _first(fs, "recover_s"),
        "redispatched": sum(f.get("redispatched", 0) for f in fs),
        "wasted_prefill_tokens": sum(f.get("wasted_prefill_tokens", 0) for f in fs),
        "hung": sum(f.get("hung", 0) for f in ends),
        "unfinished_after_end_s": max((f["unfinished_after_end_s"] for f in ends),
                                      default=None),
        "kv_retries": s.get("kv_retries", 0), "kv_reprefills": s.get("kv_reprefills", 0),
        # the last fault's end: when success came back (None: no request after it completed)
        "success_after_end_s": ends[-1]["success_after_end_s"] if ends else None,
        "failed_after_end": ends[-1]["failed_after_end"] if ends else None}


def _markdown(m, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in m[columns].itertuples(index=False):
        cells = []
        for c, v in zip(columns, r):
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("-")
            else:
                cells.append(FORMATS.get(c, "{}").format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_matrix(top, runs, summaries):
    """failure_matrix.csv and .md in the top directory of an experiment whose variants inject
    faults: one row per run; p90 TTFT inflation against the run without faults (fault `none`)
    of the same policy and failover setting. With WAN faults (link, flap, blackhole, reject,
    reset) also conformance.csv and .md: lost, hung, the longest a request stayed unfinished
    after the fault ended, KV retries and re-prefills, when success returned after it."""
    m = pd.DataFrame([_matrix_row(exp, s) for exp, s in zip(runs, summaries)])
    base = m[m.fault == "none"].set_index(["policy", "failover"]).p90_ttft_ms
    m["baseline_p90_ttft_ms"] = [base.get((p, f)) for p, f in zip(m.policy, m.failover)]
    m["p90_inflation"] = m.p90_ttft_ms / m.baseline_p90_ttft_ms
    rd = RunDir(top)
    m[MATRIX_COLUMNS].to_csv(rd.failure_matrix, index=False)
    rd.failure_matrix_md.write_text(_markdown(m, MATRIX_COLUMNS))
    if any(f.kind in WAN_KINDS for exp in runs for f in exp.faults):
        m[CONFORMANCE_COLUMNS].to_csv(rd.conformance, index=False)
        rd.conformance_md.write_text(_markdown(m, CONFORMANCE_COLUMNS))
    return m[MATRIX_COLUMNS]

