"""Analyse: one run directory's records -> requests.parquet, tokens.parquet, summary.json.

Place in the architecture: the top of the analysis floor, the one orchestrator. It reads the
run directory only (`testbed.rundir`, `testbed.records`: the Experiment from its config.yaml,
the scale from runtime.json, the emulated links from deployment.json; nothing is recompiled)
and calls the pure calculations: `testbed.metrics` (requests, tokens, the summary's measured
keys), `testbed.fidelity` (guards), `testbed.faults` (accounting, recovery) and
`testbed.loadstats` (external clients). So the run itself, `testbed analyse RUN_DIR`, and a
directory copied elsewhere are analysed alike, a run that was killed (SIGKILL, power cut)
included.

Stamps taken on other hosts than the orchestrator's (prefill, decode, the client on the ray
backend) are moved onto the orchestrator's clock by the offsets metadata.json records
(`testbed.records.read_records`) before anything compares them; requests.jsonl stays raw.

`summary.json` says `incomplete: true` and why (`incomplete_reason`) when the records show the
run did not end normally: no metadata.json (the orchestrator never reached its teardown), an
interruption or error in events.csv, or no `finished` line from the client. `not_finished`
counts requests sent without a reply on record, `not_sent` those never sent; both are among
`failed`. `write_sweep` and `table` compare the runs of one experiment.
"""

from __future__ import annotations

import json

import pandas as pd

from testbed import (clocks, deploy, excess, faults, fidelity, loadstats, metrics, replicates,
                     rundir, stats)
from testbed.net.linkmodel import DIRECTIONS
from testbed.records import RunDir, client_finished, read_events, read_records
from testbed.workload import summarize as workload_stats


def analyse(run_dir) -> dict:
    """A run directory's records -> requests.parquet, tokens.parquet, summary.json (returned).

    Reads only the directory (`testbed.rundir.load_run`): the run that just ended, `testbed
    analyse` of a killed run, and a directory copied to another machine go the same way."""
    run = rundir.load_run(run_dir)
    rd, exp, scale = run.dir, run.experiment, run.scale
    workload = rundir.workload(rd)
    if exp.workload.client != "builtin":     # what the front door received
        workload = loadstats.served_workload(rd.path, scale)
    sent, done = read_records(rd.records, run.metadata.get("clocks"))
    events = read_events(rd.events, run.metadata.get("clocks"))
    df = metrics.build_requests(workload, sent, done, scale)
    sent, done = set(sent), set(done)   # the ids: the records are in df now (memory)
    df["slo_ok"] = metrics.meets_slo(df, exp.slo.objectives_ms())
    ts = fidelity.flag_artifacts(rundir.timeseries(rd), scale)
    df = excess.decompose(df, run, ts, links(run), events)   # the TTFT's legs, their excess
    metrics.tokens_table(df, scale).to_parquet(rd.tokens, index=False)
    df.drop(columns=["token_times", "client_times"], errors="ignore").to_parquet(
        rd.requests, index=False)
    summary = metrics.summarize(df, run, ts, run.metadata.get("wan_counters"), events)
    _add_excess(summary, df, scale)
    reasons = incomplete_reasons(rd, events)
    ids = set(int(i) for i in workload.id)
    summary["incomplete"] = bool(reasons)
    summary["incomplete_reason"] = "; ".join(reasons) or None
    summary["not_finished"] = len((sent - done) & ids)
    summary["not_sent"] = len(ids - sent - done)
    summary["workload"] = workload_stats(workload)
    if exp.scheduler.roles.enabled:
        summary["role_conversions"] = metrics.role_conversions(events, scale)
    summary.update(_run_facts(run))
    guards, guard_warnings = fidelity.guards(df, run, ts, run.metadata, links(run), rd.logs)
    summary.update(guards)
    summary["warnings"] = _warnings(summary, run.metadata, reasons, guard_warnings)
    summary.update(faults.analyse(rd.path, exp, df, scale))   # accounting, recovery per fault
    if exp.workload.client != "builtin":
        summary.update(loadstats.summarize(rd.path, exp, df, scale))
    rd.summary.write_text(json.dumps(summary, indent=1))
    return summary


def _add_excess(summary, df, scale):
    """summary.json's `emulation.ttft_excess_ms` and its warning (testbed/excess.py), for a
    run whose records carry the decomposition's stamps (none: the simulator's, older runs)."""
    out, warn = excess.summarize(df, scale.time)
    if out is None:
        return
    emu = summary.get("emulation") or {}
    emu["ttft_excess_ms"] = out
    emu["warnings"] = emu.get("warnings", []) + warn
    summary["emulation"] = emu


def _run_facts(run) -> dict:
    """The summary's keys about the run itself: its directory, clocks, pools, link warnings."""
    rd, meta = run.dir, run.metadata
    exp = run.experiment
    out = {"run_dir": str(rd.path), "seed": exp.seed, "replicate": exp.replicate,
           "load": exp.load, "offered_rate": exp.workload.arrival.rate}
    out["clock_offsets"] = {h: {k: c.get(k) for k in ("offset_s", "uncertainty_s", "drift_s")}
                            for h, c in (meta.get("clocks") or {}).get("hosts", {}).items()}
    pools = {dc: json.loads(p.read_text()) for dc, p in rd.cache_pools().items()}
    if pools:
        out["cache_pools"] = pools
    return out


def link_judgement(summary: dict, meta: dict) -> tuple[list[str], list[str]]:
    """(warnings, notes) of the run's link probe: its warnings, but a goodput shortfall that
    did not bear on this run (`fidelity.link_shortfall`) as a note that says why."""
    warn = list((meta.get("link_fidelity") or {}).get("warnings", []))
    short = (summary.get("fidelity") or {}).get("link_shortfall")
    if not short or short["bears"] or short["warning"] not in warn:
        return warn, []
    warn.remove(short["warning"])
    peak = ("" if short["peak_share"] is None else
            f"; the kv link's busiest counter sample carried {short['peak_share']:.0%} of its "
            "rate")
    sent = (f"at the {short['carried']:.0%} of the rate it carried, each of its "
            f"{short['transfers']} KV transfers would still have ended with its sender's last "
            "byte" if short["transfers"] else "it sent no KV transfer across the WAN")
    return warn, [f"the link probe's {short['warning']} (bulk TCP, this machine) did not bear "
                  f"on this run: {sent}{peak}"]


def links(run) -> dict:
    """The emulated links the run's shaper ran, from deployment.json. A directory written
    before deployment.json existed has them recomputed from its config.yaml, the one place
    analysis converts link parameters itself (`testbed.deploy.emulated_link`)."""
    if run.links is not None:
        return run.links
    wan = run.experiment.network.wan
    return {d: deploy.emulated_link(wan.direction(d), run.scale, d) for d in DIRECTIONS}


def incomplete_reasons(run_dir, events=None) -> list[str]:
    """Why a run directory's records are incomplete; [] when the run ended normally (`events`:
    its events.csv rows, read here when not given)."""
    rd = RunDir(run_dir)
    reasons = []
    if not rd.metadata.exists():
        reasons.append("the orchestrator stopped before its teardown (no metadata.json: killed)")
    for e in read_events(rd.events) if events is None else events:
        if e.kind == "interrupted":
            reasons.append("interrupted (Ctrl-C, SIGTERM, SIGHUP or SIGQUIT)")
        elif e.kind == "error":
            reasons.append(f"the run failed: {e.detail}")
    if not client_finished(rd):
        reasons.append("the client did not finish (no 'finished' record in requests.jsonl)")
    return reasons


def _warnings(summary: dict, meta: dict, reasons: list[str], guards: list[str]) -> list[str]:
    summary["link_warnings"], summary["link_notes"] = link_judgement(summary, meta)
    out = summary["link_warnings"] + (summary.get("emulation") or {}).get("warnings", [])
    out += [f"scheduled link change at {e['at_s']:g}s (emulated) failed: {e['error']}"
            for e in meta.get("link_schedule_errors") or []]
    out += guards          # testbed/fidelity.py: transfers, rate artifacts, TCP timeouts
    out += clocks.warnings(meta.get("clocks"))
    if reasons:
        out.append(f"incomplete run: {'; '.join(reasons)}")
    return out




def write_sweep(top, summaries: list[dict]) -> None:
    rows = [{k: v for k, v in s.items() if not isinstance(v, (dict, list))} for s in summaries]
    pd.DataFrame(rows).to_csv(RunDir(top).sweep, index=False)


def table(summaries: list[dict]) -> str:
    """The comparison printed at the end of `testbed run` (real-world units): one row per run,
    or with replicates one row per run label, each value the median [95% CI] over seeds."""
    if replicates.has_replicates(summaries):
        return replicate_table(summaries)
    cols = [("label", "run", "{}"), ("completed", "done", "{:d}"), ("failed", "fail", "{:d}"),
            ("request_throughput", "req/s", "{:.3f}"), ("mean_ttft_ms", "TTFT mean", "{:.0f}"),
            ("median_ttft_ms", "p50", "{:.0f}"), ("p90_ttft_ms", "p90", "{:.0f}"),
            ("p99_ttft_ms", "p99", "{:.0f}"), ("mean_tpot_ms", "TPOT", "{:.1f}"),
            ("egress_mean_gbps", "egress Gb/s", "{:.2f}"),
            ("offload_fraction", "offload", "{:.2f}")]
    cols.insert(4, ("steady_throughput", "steady", "{:.3f}"))
    if any(s.get("request_goodput") is not None for s in summaries):
        cols.insert(5, ("request_goodput", "goodput", "{:.3f}"))
    if any(s.get("cache_enabled") for s in summaries):
        cols.append(("cache_hit_share", "cache hit", "{:.3f}"))
    header = [c[1] for c in cols] + ["predicted (paper)", "predicted (E[T])", "p50 model",
                                     "p90 model"]
    body = []
    for s in summaries:
        row = []
        for key, _, fmt in cols:
            v = s.get(key)
            row.append("-" if v is None else fmt.format(v))
        pred = s.get("prediction") or {}
        for key in ("lambda_max", "lambda_max_expected"):
            row.append("-" if pred.get(key) is None else f"{pred[key]:.3f}")
        model = pred.get("ttft") or {}      # the TTFT model at the run's load (plan/ttft.py)
        for key in ("median_ttft_ms", "p90_ttft_ms"):
            row.append("-" if model.get(key) is None else f"{model[key]:.0f}")
        body.append(row)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


REPLICATE_COLUMNS = (("request_throughput", "req/s", "{:.3f}"),
                     ("steady_throughput", "steady", "{:.3f}"),
                     ("median_ttft_ms", "TTFT p50", "{:.0f}"), ("p90_ttft_ms", "p90", "{:.0f}"),
                     ("mean_tpot_ms", "TPOT", "{:.1f}"),
                     ("egress_mean_gbps", "egress Gb/s", "{:.2f}"),
                     ("offload_fraction", "offload", "{:.2f}"))


def replicate_table(summaries: list[dict]) -> str:
    """One row per run label over its replicates: n counted/run, each metric's median [CI],
    the planner's Lambda_max (E[T]); then what the brackets are and which replicates were
    excluded (failed or cut short) and why."""
    rows = replicates.aggregate(summaries)
    header = ["run", "n"] + [name for _, name, _ in REPLICATE_COLUMNS] + ["predicted (E[T])"]
    body, methods = [], []
    for r in rows:
        cells = [r["label"], f"{r['n']}/{r['n_total']}"]
        for key, _, fmt in REPLICATE_COLUMNS:
            cells.append(r[key].fmt(fmt))
            methods.append(r[key].method)
        lam = (r["first"].get("prediction") or {}).get("lambda_max_expected")
        cells.append("-" if lam is None else f"{lam:.3f}")
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    lines.append(stats.method_note(methods))
    lines += [f"warning: {w}" for w in replicates.warnings(rows)]
    return "\n".join(lines)
