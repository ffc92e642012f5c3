"""Metrics: pure calculations from a run's records to its numbers (as vLLM's `calculate_metrics`).

`build_requests` joins the typed records of requests.jsonl (`testbed.records`) to
`workload.parquet`: one row per request, a request that was sent but has no `done` line, or
never sent, kept and marked failed with the reason. Metric definitions follow `vllm bench serve`:

- TTFT: first token received by the client - send time.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request, then averaged.
- ITL: gaps between consecutive tokens (decode-worker stamps).
- E2EL: last token received - send time.
- throughput: completed requests / (last completion - first send).

Times measured on the emulated timeline are converted back to real-world units by the run's
`testbed.scale.Scale` (durations `real_ms`, rates `real_rate`). The summary keys are real-world
milliseconds, seconds, requests/s and Gbit/s (1e9 bit/s).

Nothing here reads a file: `testbed.analysis` reads the run directory and calls these.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from testbed import fidelity, plan
from testbed import profile as profiles
from testbed.rundir import RunInfo
from testbed.scale import Scale

SUMMARY_KEYS = [
    "label", "policy", "completed", "failed", "duration_s", "request_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "egress_mean_gbps", "egress_peak_gbps",
    "offload_fraction", "wan_bytes_measured", "kv_bytes_sent_remote", "cache_hit_share",
    "prefill_tokens_computed", "kv_bytes_saved_by_cache", "prefix_transfer_bytes",
]


CACHE_COLUMNS = ("cached_len", "planned_cached_len", "decode_cached_len", "cache_fetch_bytes",
                 "cache_put_bytes", "cache_fetch_s", "prefix_transfer_bytes",
                 "decode_cache_bytes", "lookup_local", "lookup_prfaas")


def build_requests(workload: pd.DataFrame, sent: dict, done: dict,
                   scale: Scale) -> pd.DataFrame:
    """One row per workload request, measured fields joined, durations in real-world ms."""
    cols = _request_columns(workload, sent, done)
    # (no rows: `testbed up` that served nothing; the columns still exist)
    df = pd.DataFrame(cols if len(workload) else None, columns=None if len(workload) else [
        "id", "arrival_s", "input_len", "output_len", "status"])
    del cols
    for col in ("send_time", "first_token", "last_token", "prefill_queued", "prefill_start",
                "prefill_end", "send_start", "send_end", "kv_recv_start", "kv_recv_end",
                "decode_join", "lateness_s", "kv_bytes", "kv_bytes_sent", "n_tokens",
                "overlap_s", "end_time", *CACHE_COLUMNS):
        if col not in df:
            df[col] = np.nan
        df[col] = pd.to_numeric(df[col], errors="coerce")
    for col in ("route", "prefill_instance", "decode_instance", "error", "cache_source"):
        if col not in df:
            df[col] = None
    # Where the prefix came from: the route's source when the prefill really continued from it.
    df["cache_source"] = df.cache_source.where(df.cached_len.fillna(0) > 0, "").fillna("")
    ms = scale.real_ms
    df["ttft_ms"] = ms(df.first_token - df.send_time)
    df["e2el_ms"] = ms(df.last_token - df.send_time)
    n = df.n_tokens.where(df.n_tokens > 1)
    df["tpot_ms"] = (df.e2el_ms - df.ttft_ms) / (n - 1)
    df["prefill_ms"] = ms(df.prefill_end - df.prefill_start)
    df["prefill_queue_ms"] = ms(df.prefill_start - df.prefill_queued)
    df["transfer_ms"] = ms(df.kv_recv_end - df.kv_recv_start)
    df["transfer_after_prefill_ms"] = ms(df.kv_recv_end - df.prefill_end)
    df["decode_queue_ms"] = ms(df.decode_join - df.kv_recv_end)   # waiting for a batch slot
    df["mean_itl_ms"] = [
        ms(float(np.mean(np.diff(t)))) if isinstance(t, list) and len(t) > 1 else np.nan
        for t in df.get("token_times", pd.Series([None] * len(df)))]
    df["lateness_ms"] = df.lateness_s * 1e3     # of the emulated schedule, not scaled
    return df


def _request_columns(workload, sent, done) -> dict:
    """The rows of `build_requests` as {column: values}, in the order of first appearance and
    NaN where a row lacks the key, as pandas makes a table of the rows themselves, without a
    dict a row held for all of them at once (a million requests: docs/sim.md, Cost)."""
    cols, n = {}, 0
    for w in workload.itertuples(index=False):
        rid = int(w.id)
        row = {"id": rid, "arrival_s": float(w.arrival_s), "input_len": int(w.input_len),
               "output_len": int(w.output_len)}
        d, s = done.get(rid), sent.get(rid)
        if d is not None:
            row.update(d.columns())
        elif s is not None:
            row.update(send_time=s.send_time, status="failed",
                       error="no reply recorded before the run ended")
        else:
            row.update(status="failed", error="never sent (the run ended first)")
        if s is not None:
            row["lateness_s"] = s.lateness_s
        for k, v in row.items():
            col = cols.get(k)
            if col is None:
                col = cols[k] = []
            if len(col) < n:
                col.extend([np.nan] * (n - len(col)))
            col.append(v)
        n += 1
    for col in cols.values():
        col.extend([np.nan] * (n - len(col)))
    return cols


def tokens_table(df: pd.DataFrame, scale: Scale) -> pd.DataFrame:
    """One row per output token: its time at the decode worker and at the client (Unix s, the
    emulated timeline) and the inter-token latency at each (real-world ms). The client receives
    tokens in chunks (the first alone, then every few ms), so its times step per chunk."""
    ids, idx, dec, cli = [], [], [], []
    for rid, t_dec, t_cli in zip(df.id, df.get("token_times", [None] * len(df)),
                                 df.get("client_times", [None] * len(df))):
        if not isinstance(t_dec, list):
            continue
        n = len(t_dec)
        ids += [rid] * n
        idx += range(n)
        dec += t_dec
        cli += t_cli if isinstance(t_cli, list) and len(t_cli) == n else [np.nan] * n
    out = pd.DataFrame({"id": np.asarray(ids, dtype=np.int64), "index": np.asarray(idx, dtype=np.int64),
                        "decode_time": np.asarray(dec, dtype=float),
                        "client_time": np.asarray(cli, dtype=float)})
    first = out["index"] == 0
    out["itl_decode_ms"] = scale.real_ms(out.groupby("id").decode_time.diff().where(~first))
    out["itl_client_ms"] = scale.real_ms(out.groupby("id").client_time.diff().where(~first))
    return out


def decode_steps(df: pd.DataFrame, model, scale: Scale) -> pd.DataFrame:
    """Every decode step, rebuilt from the tokens: all tokens one step emits carry the same
    time stamp at their decode instance. One row per step with its batch size, the context
    tokens the batch held, the measured step time (since the instance's previous step, only
    where a request continued from that step, so idle gaps are not counted) and what the
    decode model (`testbed.profile.DecodeModel`, real-world) asked for; both real-world ms.

    Array code (a 600-request run at 1,024 tokens has ~600,000 tokens, ~50,000 steps): steps
    are the runs of equal (instance, time) after a sort, and a step continued from its
    instance's previous one when one of its requests emitted its previous token there."""
    cols = ["decode_instance", "time", "batch", "context", "measured_ms", "expected_ms"]
    tok = _decode_tokens(df)
    if tok is None:
        return pd.DataFrame(columns=cols)
    names, inst, t, rid, ctx = tok
    order = np.lexsort((t, inst))                     # by instance, then time
    inst, t, rid, ctx = inst[order], t[order], rid[order], ctx[order]
    new = np.ones(len(t), dtype=bool)
    new[1:] = (inst[1:] != inst[:-1]) | (t[1:] != t[:-1])
    step = np.cumsum(new) - 1                         # each token's step
    first = np.flatnonzero(new)
    n = len(first)
    batch = np.bincount(step, minlength=n)
    context = np.bincount(step, weights=ctx, minlength=n).astype(np.int64)
    # the step of each request's previous token (tokens by request, then time)
    by_req = np.lexsort((t, rid))
    r_sorted, s_sorted = rid[by_req], step[by_req]
    cont = np.zeros(len(t), dtype=bool)
    cont[1:] = (r_sorted[1:] == r_sorted[:-1]) & (s_sorted[:-1] == s_sorted[1:] - 1)
    continued = np.zeros(n, dtype=bool)
    continued[s_sorted[cont]] = True
    step_inst, step_t = inst[first], t[first]       # instance codes, stamps
    prev_t = np.empty(n)
    prev_t[0] = np.nan
    prev_t[1:] = np.where(step_inst[1:] == step_inst[:-1], step_t[:-1], np.nan)
    measured = np.where(continued, scale.real_ms(step_t - prev_t), np.nan)
    # A token's index is how many its request held before the step: `context` is what the
    # decode worker summed when it chose the step's duration.
    return pd.DataFrame({"decode_instance": names[step_inst], "time": step_t,
                         "batch": batch, "context": context, "measured_ms": measured,
                         "expected_ms": model.step_time(batch, context) * 1e3})[cols]


def _decode_tokens(df):
    """(instance names, then per token: instance (index into the names, sorted), time, request
    id, context) as arrays, or None when no request has token stamps. Tokens of a request
    without a decode instance, and stamps that are not finite, are left out (as a group-by on
    them would)."""
    reqs = [(i, r, n_in, times) for i, r, n_in, times in zip(
                df.decode_instance, df.id, df.input_len,
                df.get("token_times", [None] * len(df)))
            if isinstance(times, list) and times and isinstance(i, str)]
    if not reqs:
        return None
    names = sorted({q[0] for q in reqs})
    code = {name: k for k, name in enumerate(names)}
    sizes = np.array([len(q[3]) for q in reqs])
    inst = np.repeat([code[q[0]] for q in reqs], sizes)
    rid = np.repeat(np.array([q[1] for q in reqs], dtype=np.int64), sizes)
    t = np.concatenate([np.asarray(q[3], dtype=float) for q in reqs])
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    ctx = np.repeat(np.array([q[2] for q in reqs], dtype=np.int64), sizes) + (
        np.arange(len(t)) - starts)
    keep = np.isfinite(t)
    if not keep.any():
        return None
    return np.array(names, dtype=object), inst[keep], t[keep], rid[keep], ctx[keep]


def _pct(series, q):
    s = series.dropna()
    return float(np.percentile(s, q)) if len(s) else float("nan")


def summarize(df: pd.DataFrame, run: RunInfo, timeseries: pd.DataFrame | None = None,
              counters: dict | None = None, events=()) -> dict:
    """The run's metrics (summary.json's measured keys) from its requests table (`events`:
    events.csv's rows, `testbed.records.read_events`)."""
    ok = df[df.status == "ok"]
    exp, scale = run.experiment, run.scale
    t0 = df.send_time.min()
    t1 = ok.last_token.max() if len(ok) else float("nan")
    span_emul = (t1 - t0) if len(ok) else float("nan")
    duration_s = scale.real_s(span_emul)
    out = {
        "label": run.label, "policy": run.policy,
        "requests": int(len(df)), "completed": int(len(ok)), "failed": int(len(df) - len(ok)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s and duration_s > 0 else 0.0,
        "mean_ttft_ms": float(ok.ttft_ms.mean()), "median_ttft_ms": _pct(ok.ttft_ms, 50),
        "p90_ttft_ms": _pct(ok.ttft_ms, 90), "p99_ttft_ms": _pct(ok.ttft_ms, 99),
        "mean_tpot_ms": float(ok.tpot_ms.mean()), "p99_tpot_ms": _pct(ok.tpot_ms, 99),
        "mean_itl_ms": float(ok.mean_itl_ms.mean()), "mean_e2el_ms": float(ok.e2el_ms.mean()),
        "mean_decode_queue_ms": float(ok.decode_queue_ms.mean()),
        "p90_decode_queue_ms": _pct(ok.decode_queue_ms, 90),
        "offload_fraction": float((df.route == "remote").mean()) if len(df) else 0.0,
        "kv_bytes_sent_remote": int(df.kv_bytes_sent[df.route == "remote"].fillna(0).sum()),
        "kv_bytes_received_remote": int(df.kv_bytes[df.route == "remote"].fillna(0).sum()),
        "mean_send_lateness_ms": float(df.lateness_ms.mean()),
        "p99_send_lateness_ms": _pct(df.lateness_ms, 99),
        "scale": scale.to_dict(),
    }
    out.update(goodput(df, exp.slo.objectives_ms(), duration_s))
    out.update(egress(fidelity.without_artifacts(timeseries), t0, t1, scale))
    if counters:
        out["wan_bytes_counted"] = counters.get("kv", {}).get("tx_bytes")
    errors = df.error[df.status != "ok"].dropna().value_counts()
    out["failure_reasons"] = {str(k): int(v) for k, v in errors.head(5).items()}
    out["steady_throughput"] = steady_throughput(ok.last_token, scale)
    out["emulation"] = emulation_fidelity(ok, run, events)
    out.update(cache_summary(df, run))
    # The planner's L is the uncached length: what the run really prefilled.
    out["prediction"] = predicted(exp, (df.input_len - df.cached_len.fillna(0)).to_numpy(),
                                  df.output_len.to_numpy(), df.arrival_s.to_numpy())
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def meets_slo(df, objectives_ms):
    """Per request: completed and within every objective ({"ttft"|"tpot"|"e2el": ms}).

    As `vllm bench serve --goodput`: a request with a single output token has no TPOT and meets
    a TPOT objective; a failed request meets none.
    """
    good = df.status == "ok"
    for metric, limit in objectives_ms.items():
        value = df[f"{metric}_ms"]
        if metric == "tpot":
            value = value.fillna(0.0)
        good &= value <= limit
    return good


def goodput(df, objectives_ms, duration_s):
    """request_goodput (good requests per real-world second over the measured span) and SLO
    attainment per objective and for all together, over completed and over sent requests."""
    if not objectives_ms:
        return {"request_goodput": None, "slo": None}
    ok = df[df.status == "ok"]
    good = meets_slo(df, objectives_ms)
    attained = {m: float(meets_slo(ok, {m: v}).mean()) if len(ok) else None
                for m, v in objectives_ms.items()}
    attained["all"] = float(good[df.status == "ok"].mean()) if len(ok) else None
    rate = int(good.sum()) / duration_s if duration_s and duration_s > 0 else 0.0
    return {"request_goodput": rate,
            "slo": {"objectives_ms": objectives_ms, "good": int(good.sum()),
                    "attainment": attained,
                    "attainment_of_sent": float(good.mean()) if len(df) else None}}
def cache_summary(df: pd.DataFrame, run: RunInfo) -> dict:
    """Prefix cache keys of summary.json (docs/cache.md). Bytes are emulated bytes, like
    `wan_bytes_measured` (`Scale.real_bytes` for real-world)."""
    exp = run.experiment
    done = df[df.prefill_end.notna()]
    inp = float(df.input_len.sum())
    cached = done.cached_len.fillna(0)
    out = {"cache_enabled": exp.cache.enabled, "placement": exp.scheduler.placement,
           "cache_hit_share": float(cached.sum() / inp) if inp else 0.0,
           "prefill_tokens_computed": int((done.input_len - cached).sum()),
           "prefix_transfer_bytes": int(df.prefix_transfer_bytes.fillna(0).sum()),
           "cache_fetch_bytes": int(df.cache_fetch_bytes.fillna(0).sum()
                                    + df.decode_cache_bytes.fillna(0).sum())}
    try:
        prof = profiles.load(exp.model.profile)
        full = run.scale.emulated_bytes(prof.s_kv(done.input_len.to_numpy(dtype=float)))
        out["kv_bytes_saved_by_cache"] = int(max(0.0, float(
            (full - done.kv_bytes_sent.fillna(0).to_numpy()).sum()))) if exp.cache.enabled else 0
    except Exception:   # noqa: BLE001  a summary never fails on the profile
        out["kv_bytes_saved_by_cache"] = None
    for route, dc in (("local", "local"), ("remote", "prfaas")):
        sub = done[done.route == route]
        n = float(sub.input_len.sum())
        out[f"cache_hit_share_{dc}"] = float(sub.cached_len.fillna(0).sum() / n) if n else None
    srcs = done.cache_source[cached > 0].value_counts()
    out["cache_hits_by_source"] = {str(k): int(v) for k, v in srcs.items()}
    return out


def steady_throughput(completions: pd.Series, scale: Scale, lo=0.1, hi=0.9) -> float:
    """Completions per real-world second between the 10th and 90th percentile completion.

    `request_throughput` divides by the whole span, ramp-up (the first TTFT) and the last
    request's decode included; this middle window is what a saturated system sustains (its
    capacity) and what an unsaturated one is offered.
    """
    t = np.sort(completions.dropna().to_numpy())
    if len(t) < 10:
        return float("nan")
    a, b = t[int(lo * (len(t) - 1))], t[int(hi * (len(t) - 1))]
    n = int(hi * (len(t) - 1)) - int(lo * (len(t) - 1))
    return n / scale.real_s(b - a) if b > a else float("nan")


def emulation_fidelity(ok: pd.DataFrame, run: RunInfo, events=(), tolerance=0.05) -> dict:
    """Did the emulated accelerators keep their profiled times on this machine?

    Compares what the workers measured with what the profile asked for: mean decode step (ITL
    at the decode worker) vs T_decode, and prefill compute time vs T_prefill(l); and how long
    first tokens took from the decode worker to the client (the testbed's own control plane).
    A CPU too busy for the chosen `scale.time` shows here first; the warning says so.
    """
    exp, scale = run.experiment, run.scale
    if exp.model.engine != "profile" or not len(ok):
        return {}
    prof = profiles.load(exp.model.profile)
    steps = decode_steps(ok, exp.decode_model(), scale).dropna(subset=["measured_ms"])
    steps = steps[~_in_instance_faults(steps, events, scale)]
    out = {"warnings": []}
    if len(steps):
        # Time-weighted: the measured decode time over what the model asked for those steps.
        out["decode_step_ratio"] = float(steps.measured_ms.sum() / steps.expected_ms.sum())
        out["decode_batch_mean"] = float(steps.batch.mean())
    accel = {"remote": exp.clusters.prfaas.accelerator, "local": exp.clusters.local.accelerator}
    ratios = []
    for route, acc in accel.items():
        sub = ok[(ok.route == route) & ok.prefill_ms.notna()]
        if len(sub):
            cached = sub.cached_len.fillna(0).to_numpy() if "cached_len" in sub else 0
            want = np.asarray(prof.t_prefill_cached(acc, sub.input_len.to_numpy(), cached)) * 1e3
            ratios.append(sub.prefill_ms.to_numpy() / want)
    if ratios:
        out["prefill_ratio"] = float(np.median(np.concatenate(ratios)))
    lag = [(f - t[0]) for f, t in zip(ok.first_token, ok.get("token_times", [None] * len(ok)))
           if isinstance(t, list) and t and np.isfinite(f)]
    if lag:
        out["first_token_lag_ms"] = scale.real_ms(float(np.median(lag)))
        out["first_token_lag_p99_ms"] = scale.real_ms(float(np.percentile(lag, 99)))
        if out["first_token_lag_ms"] > 50:
            out["warnings"].append(
                f"first tokens reached the client {out['first_token_lag_ms']:.0f} ms (median, "
                f"real-world) after the decode worker made them: the control plane is CPU-bound "
                f"at scale.time {scale.time:g}; TTFT includes that lag; "
                + fidelity.lower_scale_hint(scale.time))
    wake = decode_wakeups(events, scale)
    if wake:
        out["decode_wakeups"] = wake
        if wake["late_p50_ms"] > WAKE_LATE_WARN_MS:
            out["warnings"].append(
                f"decode workers woke {wake['late_p50_ms']:.0f} ms (median, real-world) after "
                f"their schedule: first tokens, last chunks and admissions came that late at "
                f"scale.time {scale.time:g}; " + fidelity.lower_scale_hint(scale.time))
    for key, what in (("decode_step_ratio", "decode steps"), ("prefill_ratio", "prefills")):
        r = out.get(key)
        if r is not None and abs(r - 1) > tolerance:
            out["warnings"].append(
                f"{what} took {r:.2f}x their profiled time: this machine could not keep up "
                f"at scale.time {scale.time:g}; " + fidelity.lower_scale_hint(scale.time))
    return out


def _in_instance_faults(steps, events, scale):
    """Per step: whether it ran on an instance while that instance's fault was in force (the
    fault's time, not the machine's; events.csv's fault_inject / fault_end `target`s)."""
    starts, ends = {}, {}
    for t, kind, f, *_ in events:
        key = (f.get("fault"), f.get("occurrence"))
        if kind in ("fault_inject", "pilot_tail") and f.get("fault_kind") in INSTANCE_FAULTS:
            starts[key] = (t, set(str(f.get("target", "")).split(",")))
        elif kind == "fault_end":
            ends[key] = t
    out = pd.Series(False, index=steps.index)
    began = steps.time - steps.measured_ms.map(lambda ms: scale.emulated_s(ms / 1e3))
    for key, (t, names) in starts.items():
        end = ends.get(key, np.inf)
        out |= steps.decode_instance.isin(names) & (began <= end) & (steps.time >= t)
    return out


INSTANCE_FAULTS = ("pause", "slow", "kill", "restart")
WAKE_LATE_WARN_MS = 50.0    # real-world: a decode worker's median wake-up lateness


def decode_wakeups(events, scale: Scale) -> dict:
    """The decode workers' `decode_wakeups` rows of events.csv (workers/decode.py, at exit):
    steps and wake-ups summed, wake-up lateness against the schedule (real-world ms) of the
    worst instance. A paced decode worker stamps the steps between its wake-ups with their
    scheduled times; a late wake-up lengthens the step it woke for (in the step ratio) and
    delays what that step sends: first tokens, last chunks, admissions. `events`:
    `testbed.records.read_events`."""
    rows = [f for _, k, f in events if k == "decode_wakeups"]
    if not rows:
        return {}
    worst = lambda key: scale.real_ms(max(float(f[key]) for f in rows) / 1e3)   # noqa: E731
    return {"instances": len(rows), "steps": sum(int(f["steps"]) for f in rows),
            "wakeups": sum(int(f["wakeups"]) for f in rows),
            "late_p50_ms": worst("late_p50_ms"), "late_p99_ms": worst("late_p99_ms"),
            "late_max_ms": worst("late_max_ms")}


def egress(ts: pd.DataFrame | None, t0: float, t1: float, scale: Scale) -> dict:
    """WAN KV-direction egress from the kernel counters over [t0, t1] (the measured span).

    mean = bytes counted / span; peak = the largest rate over windows of 1 s real-world time
    (at least two samples). Reported in real-world Gbit/s.
    """
    out = {"wan_bytes_measured": 0, "egress_mean_gbps": 0.0, "egress_peak_gbps": 0.0,
           "request_bytes_measured": 0}
    if ts is None or not len(ts) or not np.isfinite(t0):
        return out
    # A row's time is when its counter read began; a read stalled by a busy CPU (180 ms seen)
    # returns counts from up to `read_s` later, so the start row must have finished reading
    # by t0, or it already holds bytes sent after it (a whole KV cache, once).
    read_done = ts.time + ts.read_s if "read_s" in ts else ts.time
    before = ts[read_done <= t0]
    start = before.iloc[-1] if len(before) else ts.iloc[0]
    end_t = t1 if np.isfinite(t1) else ts.time.iloc[-1]
    after = ts[ts.time >= end_t]
    end = after.iloc[0] if len(after) else ts.iloc[-1]
    span = end.time - start.time
    out["wan_bytes_measured"] = int(end.kv_tx_bytes - start.kv_tx_bytes)
    out["request_bytes_measured"] = int(end.request_tx_bytes - start.request_tx_bytes)
    if span > 0:
        out["egress_mean_gbps"] = scale.real_rate(out["wan_bytes_measured"] * 8 / span) / 1e9
    win = ts[(ts.time >= start.time) & (ts.time <= end.time)]
    if len(win) >= 2:
        dt = max(scale.emulated_s(1.0), float(np.median(np.diff(win.time))) * 2)
        t = win.time.to_numpy()
        b = win.kv_tx_bytes.to_numpy(dtype=float)
        j = np.searchsorted(t, t + dt)
        valid = j < len(t)
        if valid.any():
            rates = (b[j[valid]] - b[valid]) * 8 / (t[j[valid]] - t[valid])
            out["egress_peak_gbps"] = scale.real_rate(float(rates.max())) / 1e9
    return out


def predicted(exp, input_lengths=None, output_lengths=None, arrival_times=None) -> dict:
    """The planner's prediction for this run's configuration, from the uncached lengths the run
    really prefilled (input_len - cached_len: the full lengths when the cache is off) and the
    output lengths it asked for (so no workload is regenerated: a trace need not be at hand).
    With the request list's `arrival_times` (real-world s), also the TTFT model's prediction
    at that load (`ttft`: mean, median, p90, p99 ms and each stage's utilisation;
    testbed/plan/ttft.py)."""
    if exp.model.engine != "profile":
        return {"note": "the planner models profiled accelerators; the torch engine's timing "
                        "is its own (no prediction)"}
    try:
        out = plan.predict(exp, lengths=input_lengths, output_lengths=output_lengths)
        if arrival_times is not None and len(arrival_times) >= 3:
            inp = plan.inputs_for(exp, input_lengths, output_lengths=output_lengths)
            out["ttft"] = plan.predict_ttft_for(exp, inp, arrival_times)
        return out
    except Exception as e:  # a prediction must never lose a measured run
        return {"error": f"{type(e).__name__}: {e}"}


def role_conversions(events, scale: Scale) -> dict:
    """The long timescale's role conversions (events.csv `role` rows, workers/roles.py; `events`:
    `testbed.records.read_events`): how many finished and failed, each way, and the median
    drain and conversion time (real-world s)."""
    roles = [f for _, k, f in events if k == "role"]
    done = [f for f in roles if f.get("state") == "done"]
    failed = [f for f in roles if f.get("state") == "failed"]

    def median_real_s(key):
        xs = [float(f[key]) for f in done if f.get(key) not in (None, "")]
        return float(scale.real_s(np.median(xs))) if xs else None

    return {"done": len(done), "failed": len(failed),
            "to_decode": sum(f.get("to") == "decode" for f in done),
            "to_prefill": sum(f.get("to") == "prefill" for f in done),
            "drain_s_median": median_real_s("drain_s"),
            "convert_s_median": median_real_s("convert_s")}


