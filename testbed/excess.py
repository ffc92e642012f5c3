"""Every TTFT split into its legs, and the part of each leg the emulation added (issue 22).

Place in the architecture: analysis (`testbed.analysis.analyse`) calls `decompose` on the
requests table and `summarize` for summary.json's `emulation.ttft_excess_ms`. Pure
calculations on the stamps the processes took (testbed.records.RequestRecord), emulated
seconds in, real-world ms out.

A request's TTFT (first token at the client - send) is the sum of eight legs, each between two
stamps:

| leg | from -> to | what the emulated system itself would take |
|---|---|---|
| send | client send -> scheduler got it | nothing (client and scheduler share a datacenter) |
| route | scheduler got it -> prefill worker got it | the WAN's one-way delay for a PrfaaS prefill (and one round trip for the pools' lookups with the cache on) |
| prefill_queue | -> prefill compute starts | the instance's FIFO replayed with modelled prefill times |
| prefill | -> compute ends | the engine's modelled compute (`prefill_model_s`) |
| kv_transfer | -> last KV byte received | the fluid link model (testbed.fidelity) from the compute's end |
| decode_admission | -> joined the batch | one step (the step in progress) until it is first refused for capacity (`decode_held`); waiting for capacity after that |
| first_step | -> first token stamped | the first step's modelled length (`first_step_s`) |
| delivery | -> first token at the client | nothing |

With a real engine (`model.engine: vllm`) the engine's legs (prefill_queue, prefill,
decode_admission, first_step) have no model: they are the engine's own time at real speed,
the system under study, so none of them is an excess. The legs the testbed adds or shapes
(send, route, kv_transfer, delivery) keep their allowances.

The excess of a leg is what it measured beyond that (never below 0): timers and wake-ups that
fired late, an event loop that was busy, a transfer slower than the link allows. Queueing the
emulated system also has (a busy prefill instance, a full batch, a shared link) is not an
excess. The allowances are what the model gives, not what was measured on a quiet machine, so
the machine's own floor (a gRPC hop takes ~0.5 ms of real CPU, x scale.time real-world) counts
as excess: it is what the emulation adds at that scale.

A WAN fault (`faults:` kinds link, flap, blackhole, reject, reset) is the system under study:
the fluid link model has no TCP recovery (retransmission timeouts after a cut, a PMTU
blackhole, a reset connection), a prefill that streams its KV into a stalled connection is held
back by it, and failover re-prefills and re-dispatches what it held up. So the legs that cross
the WAN or wait behind it (route, prefill_queue, prefill, kv_transfer) have no excess where they
overlapped a fault's window (events.csv's fault_inject to fault_end, plus the aftermath of
backed-off retransmissions: `wan_fault_windows`); `wan_fault_overlap` marks those requests.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed import fidelity
from testbed.faultspec import WAN_KINDS

LEGS = ("send", "route", "prefill_queue", "prefill", "kv_transfer", "decode_admission",
        "first_step", "delivery")
ENGINE_LEGS = ("prefill_queue", "prefill", "decode_admission", "first_step")
REAL_ENGINES = ("vllm",)    # computed at real speed: their own legs are no excess
WARN_SHARE = 0.05           # warn when the p90 excess exceeds this share of the TTFT p90
WARN_PREFIX = "the emulation added"   # that warning's start (testbed/autojudge.py)
NAMED_SHARE = 0.10          # a leg is named in the warning from this share of the mean excess
TCP_RTO_MAX_S = 120.0       # Linux's TCP_RTO_MAX: the longest a backed-off retransmission waits
WAN_LEGS = {"route": (1, 2), "prefill_queue": (2, 3), "prefill": (3, 4), "kv_transfer": (4, 5)}


def _col(df, name):
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(
        np.nan, index=df.index)


def _first_stamp(df):
    times = df["token_times"] if "token_times" in df else pd.Series([None] * len(df), df.index)
    return pd.Series([t[0] if isinstance(t, list) and t else np.nan for t in times], df.index,
                     dtype=float)


def queue_ideal_start(df):
    """Per request (emulated Unix s): when its prefill would have started had every prefill on
    its instance taken its modelled time: each instance's FIFO (in the order it served them)
    replayed from the measured arrivals (+ the pool fetch before the queue).

    Once failover has moved a prefill to or from an instance (a record's `redispatches`), that
    instance has computed attempts no record holds (the one moved away, or one whose KV the
    decode no longer wanted), so the replay stops there: later starts on it are taken as
    measured (no queue excess)."""
    start, queued = _col(df, "prefill_start"), _col(df, "prefill_queued")
    model = _col(df, "prefill_model_s").fillna(_col(df, "prefill_end") - start)
    ready = queued + _col(df, "cache_fetch_s").fillna(0.0)
    inst = df["prefill_instance"] if "prefill_instance" in df else pd.Series(None, df.index)
    first_move = _first_moves(df)
    ok = (start.notna() & queued.notna() & inst.notna()).to_numpy()
    # Positions and arrays, not labels: a million requests (the simulator's) in seconds
    s, r, m = start.to_numpy(float), ready.to_numpy(float), model.to_numpy(float).tolist()
    out = np.full(len(df), np.nan)
    groups = {}
    for i, name in zip(np.flatnonzero(ok).tolist(), inst.to_numpy()[ok].tolist()):
        groups.setdefault(name, []).append(i)
    for name, rows in groups.items():
        rows = np.asarray(rows)
        free, moved = -np.inf, first_move.get(name, np.inf)
        for i in rows[np.argsort(s[rows], kind="quicksort")].tolist():
            free = s[i] if r[i] >= moved or s[i] >= moved else max(r[i], free)
            out[i] = free
            free += m[i]
    return pd.Series(out, index=df.index)


def _first_moves(df):
    """instance -> the first time failover moved a prefill to or from it (`redispatches`)."""
    out = {}
    for moves in df["redispatches"] if "redispatches" in df else ():
        for m in moves if isinstance(moves, (list, tuple, np.ndarray)) else ():
            if m.get("role") == "prefill":
                for name in (m.get("from"), m.get("to")):
                    if name:
                        out[name] = min(out.get(name, np.inf), float(m["time"]))
    return out


def kv_allowed_end(df, run, ts, links):
    """Per request (emulated Unix s): when its last KV byte may arrive. Over the WAN: the fluid
    link model (`testbed.fidelity.transfer_bounds`) from the compute's end, not the sender's
    last write (a late send is the emulation's); within a datacenter: the compute's end plus
    the path's round trip (`fidelity.path_allowance`)."""
    rtt, _ = fidelity.path_allowance(run, links)
    end = _col(df, "prefill_end")
    out = end + rtt
    remote = df[df.route == "remote"] if "route" in df else df.iloc[:0]
    if len(remote):
        t = remote.assign(send_end=np.minimum(_col(remote, "send_end"), end[remote.index]))
        b = fidelity.transfer_bounds(t, fidelity.link_model(run, ts, links), rtt)
        if len(b):
            allowed = pd.Series(b.allowed_s.to_numpy(), index=b.id.to_numpy())
            ids = remote.set_index("id").index
            got = allowed.reindex(ids).to_numpy() + _col(remote, "send_start").to_numpy()
            out[remote.index] = np.where(np.isfinite(got), got, out[remote.index])
    return out


def wan_fault_windows(events):
    """[(inject, end + aftermath)] of the run's WAN faults, emulated Unix s (inf: never ended),
    from events.csv's fault_inject / fault_end rows (`testbed.records.read_events`).

    The aftermath is the fault's length (at most TCP_RTO_MAX_S): a connection that was
    retransmitting through it doubled its timeout each time, so its next try after the end
    comes up to about as long after the end as the outage had lasted."""
    starts, ends = {}, {}
    for t, kind, f, *_ in events:
        key = (f.get("fault"), f.get("occurrence"))
        if kind == "fault_inject" and f.get("fault_kind") in WAN_KINDS:
            starts[key] = t
        elif kind == "fault_end":
            ends[key] = t
    out = []
    for key, t in starts.items():
        end = ends.get(key, np.inf)
        out.append((t, end + min(end - t, TCP_RTO_MAX_S)))
    return out


def _overlaps(start, end, windows):
    """Per row: whether [start, end] overlaps any window (False where a stamp is missing)."""
    out = pd.Series(False, index=start.index)
    for a, b in windows:
        out |= (start <= b) & (end >= a)
    return out


def decompose(df, run, ts, links, events=()):
    """`df` (the requests table, emulated stamps) with `leg_<leg>_ms`, `excess_<leg>_ms` and
    `excess_ms` columns (real-world ms; NaN where a stamp is missing, e.g. a run recorded
    before the stamps existed, or the simulator's), and `wan_fault_overlap` (`events`: the
    run's, for its WAN faults' windows)."""
    df = df.copy()
    ms = run.scale.real_ms
    first = _first_stamp(df)
    stamps = [_col(df, "send_time"), _col(df, "sched_received"), _col(df, "prefill_queued"),
              _col(df, "prefill_start"), _col(df, "prefill_end"), _col(df, "kv_recv_end"),
              _col(df, "decode_join"), first, _col(df, "first_token")]
    legs = {leg: stamps[i + 1] - stamps[i] for i, leg in enumerate(LEGS)}
    kv, req = links["kv"], links["request"]
    route_allow = pd.Series(0.0, index=df.index)
    if "route" in df:
        route_allow[df.route == "remote"] = req.delay_s + 3 * req.jitter_s
    if run.experiment.cache.enabled:
        route_allow += kv.delay_s + req.delay_s
    step = _col(df, "first_step_s").fillna(0.0)
    held = _col(df, "decode_held").fillna(_col(df, "decode_join"))
    excess = {
        "send": legs["send"],
        "route": legs["route"] - route_allow,
        "prefill_queue": stamps[3] - queue_ideal_start(df),
        "prefill": legs["prefill"] - _col(df, "prefill_model_s").fillna(legs["prefill"]),
        "kv_transfer": stamps[5] - np.maximum(kv_allowed_end(df, run, ts, links), stamps[4]),
        "decode_admission": np.minimum(held, stamps[6]) - stamps[5] - step,
        "first_step": legs["first_step"] - step,
        "delivery": legs["delivery"],
    }
    if run.experiment.model.engine in REAL_ENGINES:
        for leg in ENGINE_LEGS:
            excess[leg] = pd.Series(0.0, index=df.index)
    windows = wan_fault_windows(events)
    overlap = pd.Series(False, index=df.index)
    for leg, (a, b) in WAN_LEGS.items():
        hit = _overlaps(stamps[a], stamps[b], windows)
        excess[leg] = excess[leg].where(~hit, 0.0)
        overlap |= hit
    df["wan_fault_overlap"] = overlap
    for leg in LEGS:
        df[f"leg_{leg}_ms"] = ms(legs[leg])
        df[f"excess_{leg}_ms"] = ms(excess[leg].clip(lower=0.0))
    total = sum(df[f"excess_{leg}_ms"] for leg in LEGS)
    df["excess_ms"] = np.minimum(total, df.ttft_ms) if "ttft_ms" in df else total
    return df


def _p(series, q):
    s = series.dropna()
    return float(np.percentile(s, q)) if len(s) else None


def summarize(df, factor):
    """summary.json's `emulation.ttft_excess_ms` from `decompose`'s ok rows, and the warning
    (a list, empty or one line)."""
    ok = df[(df.status == "ok") & df.excess_ms.notna() & df.ttft_ms.notna()]
    if not len(ok):
        return None, []
    ttft, ex = ok.ttft_ms, ok.excess_ms
    out = {"requests": int(len(ok)), "p50": _p(ex, 50), "p90": _p(ex, 90), "p99": _p(ex, 99),
           "mean": float(ex.mean()),
           "share_p50": _p(ex, 50) / _p(ttft, 50) if _p(ttft, 50) else None,
           "share_p90": _p(ex, 90) / _p(ttft, 90) if _p(ttft, 90) else None,
           "share_mean": float(ex.sum() / ttft.sum()) if ttft.sum() > 0 else None,
           "ttft_corrected_p50": _p(ttft - ex, 50), "ttft_corrected_p90": _p(ttft - ex, 90),
           "legs": {leg: {"mean_ms": float(ok[f"leg_{leg}_ms"].mean()),
                          "excess_mean_ms": float(ok[f"excess_{leg}_ms"].mean()),
                          "excess_p90_ms": _p(ok[f"excess_{leg}_ms"], 90)} for leg in LEGS}}
    warn = []
    if out["share_p90"] is not None and out["share_p90"] > WARN_SHARE:
        named = sorted(((v["excess_mean_ms"], leg) for leg, v in out["legs"].items()
                        if v["excess_mean_ms"] >= NAMED_SHARE * out["mean"]), reverse=True)
        legs = ", ".join(f"{leg} {m:.0f} ms" for m, leg in named)
        warn.append(f"{WARN_PREFIX} {out['p90']:.0f} ms (p90, real-world) to TTFTs, "
                    f"{100 * out['share_p90']:.0f}% of the TTFT p90 ({_p(ttft, 90):.0f} ms), "
                    f"at scale.time {factor:g}; mean excess by leg: {legs}; without it "
                    f"the TTFT p50/p90 would be {out['ttft_corrected_p50']:.0f}/"
                    f"{out['ttft_corrected_p90']:.0f} ms: "
                    + fidelity.lower_scale_hint(factor))
    return out, warn
