"""External load generators, analysed: what the front door and the tool recorded.

The front door's records (requests.jsonl in the built-in client's format, frontdoor.jsonl per
HTTP request) are what the analysis reads: `served_workload` is the request list as it arrived
(the front door numbers requests in arrival order), and `summarize` adds the front door's HTTP
outcomes and, for aiperf and vllm bench serve, the tool's own metrics beside ours (summary.json
`frontdoor`, `aiperf`, `vllm_bench`). Place in the architecture: the analysis floor (`testbed.analysis` calls it).
"""

import json

import numpy as np
import pandas as pd

from testbed import clocks, rundir
from testbed.records import RunDir, jsonl, read_records
from testbed.scale import Scale


def read_http(run_dir):
    """frontdoor.jsonl's per-request `http` rows."""
    return [o for o in jsonl(RunDir(run_dir).frontdoor) if o.get("ev") == "http"]


def served_workload(run_dir, scale: Scale):
    """The request list as the front door received it (from requests.jsonl's `sent` lines):
    id, arrival_s (real-world seconds after the first arrival), input_len, output_len.
    `scale`: the run's, from its directory (`testbed.rundir.scale`)."""
    sent, _ = read_records(RunDir(run_dir).records)
    rows = sorted(sent.values(), key=lambda s: s.id)
    t0 = min((s.scheduled for s in rows), default=0.0)
    return pd.DataFrame({
        "id": np.asarray([s.id for s in rows], dtype=np.int64),
        "arrival_s": np.asarray([scale.real_s(s.scheduled - t0) for s in rows], dtype=float),
        "input_len": np.asarray([s.input_len or 0 for s in rows], dtype=np.int64),
        "output_len": np.asarray([s.output_len or 0 for s in rows], dtype=np.int64)})


def summarize(run_dir, exp, df, scale: Scale):
    """summary.json's `frontdoor` (HTTP outcomes) and, for aiperf, `aiperf` keys; `scale`: the
    run's, from its directory."""
    http = read_http(run_dir)
    out = {"frontdoor": {
        "http_requests": len(http),
        "outcomes": pd.Series([r["outcome"] for r in http], dtype=object).value_counts().to_dict(),
        "http_status": {str(k): int(v) for k, v in pd.Series(
            [r["http_status"] for r in http], dtype=object).value_counts().items()},
        # What the front door itself adds to a client's TTFT: arrival (headers read) to the
        # Submit, and first token received to handed to the connection (emulated ms, median).
        "overhead_emulated_ms_median": _overhead_ms(http, run_dir),
        # The front door's event loop lateness (emulated ms): how long a request that arrives
        # while it serves other streams waits before its handler runs.
        "loop_lag_emulated_ms": next((o.get("loop_lag_ms") for o in jsonl(
            RunDir(run_dir).frontdoor) if o.get("ev") == "summary"), None),
        "client_minus_testbed_ttft_ms": None}}
    if exp.workload.client == "aiperf":
        out["aiperf"] = aiperf_summary(run_dir, exp, df, scale)
        out["frontdoor"]["client_minus_testbed_ttft_ms"] = out["aiperf"].get(
            "compare", {}).get("ttft_diff_ms_median")
    if exp.workload.client == "vllm-bench":
        out["vllm_bench"] = vllm_bench_summary(run_dir, df, scale)
        out["frontdoor"]["client_minus_testbed_ttft_ms"] = out["vllm_bench"].get(
            "compare", {}).get("ttft_diff_ms_median")
    return out


def _overhead_ms(http, run_dir):
    sent, done = read_records(RunDir(run_dir).records)
    gaps = [(sent[h["id"]].send_time - h["arrival"]) + (h["first_token"] - done[h["id"]]
            .first_token) for h in http if h["outcome"] == "ok" and h["id"] in sent
            and h["id"] in done and h["first_token"] and done[h["id"]].first_token]
    return float(np.median(gaps) * 1e3) if gaps else None


def compare(tool, ours, scale: Scale):
    """A client's own per-request records beside the front door's, paired by id where the tool
    sent one (`our_id`: the front door's id of its X-Request-Id), else in start order (the
    front door numbers requests in arrival order).

    `tool`: DataFrame with `start` (Unix s), `ttft_s` (emulated s, NaN if none) and `ok`;
    `ours`: requests.parquet rows. Times in the result are real-world ms (`scale`: the run's),
    with the emulated per-request difference beside them."""
    t = tool.sort_values("start").reset_index(drop=True)
    o = ours.sort_values("send_time").reset_index(drop=True)
    if "our_id" in t and t.our_id.notna().all() and t.our_id.isin(ours.id).all():
        o = ours.set_index("id").loc[t.our_id.astype(int)].reset_index()   # paired by id
    n = min(len(t), len(o))
    both = (t.ok[:n].to_numpy() & (o.status[:n] == "ok").to_numpy())
    diff = (scale.real_ms(t.ttft_s[:n].to_numpy()) - o.ttft_ms[:n].to_numpy())[both]
    start_gap = (t.start[:n].to_numpy() - o.send_time[:n].to_numpy())[both]
    ok_t = t[t.ok]

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else None
    return {"requests": int(len(t)), "completed": int(t.ok.sum()),
            "completed_testbed": int((ours.status == "ok").sum()), "paired": int(both.sum()),
            "p50_ttft_ms": pct(scale.real_ms(ok_t.ttft_s), 50),
            "p90_ttft_ms": pct(scale.real_ms(ok_t.ttft_s), 90),
            "mean_ttft_ms": float(scale.real_ms(ok_t.ttft_s).mean()) if len(ok_t) else None,
            "ttft_diff_ms_median": pct(diff, 50), "ttft_diff_ms_p90": pct(diff, 90),
            "ttft_diff_emulated_ms_median": pct(scale.emulated_s(diff), 50),
            "send_before_submit_ms_median": pct(-start_gap * 1e3, 50)}


def gap_legs(tool, http, ours):
    """Where a client's TTFT differs from the testbed's, per request (paired by the client's
    request id), in emulated ms, median and p90 of each leg; their sum is the difference:

    - `client_send`: the client's request start to the front door's arrival (headers read);
    - `frontdoor_in`: arrival to Submit (body read, parsed, tokenised);
    - `frontdoor_out`: first token at the front door (gRPC) to handed to the connection;
    - `client_receive`: handed to the connection to the client's first token.

    `tool`: `start`, `ttft_s` (emulated s), `ok`, `our_id`; `http`: frontdoor.jsonl rows;
    `ours`: requests.parquet rows."""
    h = pd.DataFrame([r for r in http if r["outcome"] == "ok" and r["first_token"]],
                     columns=["id", "arrival", "first_token"])
    m = (tool[tool.ok & tool.our_id.notna()].assign(id=lambda t: t.our_id.astype(int))
         .merge(h.rename(columns={"first_token": "handed"}), on="id")
         .merge(ours[ours.status == "ok"][["id", "send_time", "first_token"]], on="id"))
    legs = {"client_send": m.arrival - m.start, "frontdoor_in": m.send_time - m.arrival,
            "frontdoor_out": m.handed - m.first_token,
            "client_receive": m.start + m.ttft_s - m.handed}
    return {"paired": int(len(m)), **{
        k: {"median": float(np.median(v) * 1e3), "p90": float(np.percentile(v, 90) * 1e3)}
        for k, v in legs.items() if len(v)}}


def read_aiperf(run_dir):
    """aiperf's per-request records (profile_export.jsonl, profiling phase) as `compare` wants."""
    rows = []
    for obj in jsonl(RunDir(run_dir).aiperf_records):
        meta, m = obj.get("metadata", {}), obj.get("metrics", {})
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue
        ttft = m.get("time_to_first_token", {}).get("value")
        lat = m.get("request_latency", {}).get("value")
        ok = not obj.get("error") and not meta.get("was_cancelled") and ttft is not None
        rows.append({"start": meta.get("request_start_ns", 0) / 1e9,
                     "rid": meta.get("x_request_id"),
                     "ttft_s": ttft / 1e3 if ttft is not None else np.nan,
                     "e2el_s": lat / 1e3 if lat is not None else np.nan,
                     "n_out": m.get("output_sequence_length", {}).get("value"), "ok": ok})
    return pd.DataFrame(rows, columns=["start", "rid", "ttft_s", "e2el_s", "n_out", "ok"])


def aiperf_summary(run_dir, exp, df, scale: Scale):
    """aiperf's metrics beside ours: its aggregate TTFT (profile_export_aiperf.json, converted
    to real-world ms) and the per-request comparison; goodput from its records under our SLO."""
    agg_path = RunDir(run_dir).aiperf_aggregate
    if not agg_path.exists():
        return {"error": f"no {agg_path.name} (see logs/client.log)"}
    agg = json.loads(agg_path.read_text())
    ttft = agg.get("time_to_first_token") or {}       # emulated ms
    out = {"request_count": (agg.get("request_count") or {}).get("avg"),
           "errors": (agg.get("error_summary") or []),
           "reported_ttft_ms": {k: scale.real_s(ttft[k]) for k in ("avg", "p50", "p90", "p99")
                                if ttft.get(k) is not None}}
    # The tool and the front door run on the client's host: onto the orchestrator's clock, as
    # analysis put the client's records (`df`, testbed/clocks.py).
    shift = clocks.instance_offsets(rundir.metadata(run_dir).get("clocks")).get("client", 0.0)
    tool = read_aiperf(run_dir)
    tool["start"] = tool.start - shift
    http = [{**h, "arrival": h["arrival"] - shift,
             "first_token": h["first_token"] and h["first_token"] - shift}
            for h in read_http(run_dir)]
    ids = {h.get("client_request_id"): h["id"] for h in http}
    tool["our_id"] = tool.rid.map(ids)       # aiperf's X-Request-Id as the front door saw it
    out["compare"] = compare(tool, df, scale)
    out["compare"]["gap_legs_emulated_ms"] = gap_legs(tool, http, df)
    slo = exp.slo.objectives_ms()
    if slo and len(tool):
        good = tool.ok.copy()
        if "ttft" in slo:
            good &= scale.real_ms(tool.ttft_s) <= slo["ttft"]
        if "e2el" in slo:
            good &= scale.real_ms(tool.e2el_s) <= slo["e2el"]
        if "tpot" in slo:
            n = tool.n_out.astype(float)
            tpot = ((tool.e2el_s - tool.ttft_s) / (n - 1)).where(n > 1, 0.0)
            good &= scale.real_ms(tpot) <= slo["tpot"]
        ok = tool[tool.ok]
        span = scale.real_s((ok.start + ok.e2el_s).max() - tool.start.min()) if len(ok) else 0.0
        out["request_goodput"] = int(good.sum()) / span if span > 0 else 0.0
    return out


def read_vllm_bench(run_dir):
    """`vllm bench serve`'s per-request results (--save-detailed) as `compare` wants: start on
    the Unix clock (its perf_counter plus the offset workers/vllm_bench.py wrote), TTFT and
    E2EL in emulated s, output tokens; and its aggregate result."""
    rd = RunDir(run_dir)
    res = json.loads(rd.vllm_bench_result.read_text())
    offset = json.loads(rd.vllm_bench_clock.read_text())["unix_minus_perf_counter_s"]
    errors = res.get("errors") or [""] * len(res["ttfts"])
    tool = pd.DataFrame({"start": np.asarray(res["start_times"], float) + offset,
                         "ttft_s": np.asarray(res["ttfts"], float),
                         "e2el_s": np.asarray(res["latencies"], float),
                         "n_out": np.asarray(res["output_lens"], float),
                         "ok": [not e for e in errors]})
    tool.loc[~tool.ok | (tool.ttft_s <= 0), "ttft_s"] = np.nan
    tool["ok"] = tool.ok & tool.ttft_s.notna()
    return tool, res


def vllm_bench_summary(run_dir, df, scale: Scale):
    """`vllm bench serve`'s metrics beside ours (real-world ms): its reported TTFT and TPOT
    percentiles, and the per-request comparison paired in start order (bench serve sends no
    request id of its own; the front door numbers requests in arrival order), TPOT too."""
    if not RunDir(run_dir).vllm_bench_result.exists():
        return {"error": "no vllm_bench/result.json (see logs/client.log)"}
    tool, res = read_vllm_bench(run_dir)
    shift = clocks.instance_offsets(rundir.metadata(run_dir).get("clocks")).get("client", 0.0)
    tool["start"] = tool.start - shift
    keys = [f"{s}_{m}_ms" for m in ("ttft", "tpot") for s in ("mean", "median", "p50", "p90",
                                                                "p99")]
    out = {"completed": res.get("completed"), "failed": res.get("failed"),
           "request_throughput_per_s": scale.emulated_s(res.get("request_throughput") or 0.0),
           "reported": {k: scale.real_s(res[k]) for k in keys if res.get(k) is not None}}
    out["compare"] = compare(tool, df, scale)
    out["compare"]["tpot_diff_ms_median"] = _tpot_diff(tool, df, scale)
    return out


def _tpot_diff(tool, ours, scale):
    """Median of the tool's TPOT minus ours (real-world ms), paired in start order."""
    t = tool.sort_values("start").reset_index(drop=True)
    o = ours.sort_values("send_time").reset_index(drop=True)
    n = min(len(t), len(o))
    tpot = scale.real_ms((t.e2el_s - t.ttft_s) / (t.n_out - 1))[:n].to_numpy()
    both = t.ok[:n].to_numpy() & (o.status[:n] == "ok").to_numpy() & (t.n_out[:n] > 1).to_numpy()
    d = (tpot - o.tpot_ms[:n].to_numpy())[both]
    return float(np.median(d)) if len(d) else None
