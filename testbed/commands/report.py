"""`testbed report RUN_DIR`: one Markdown page of a run directory, from what it holds only.

The comparison table (measured beside both planner predictions), emulation and link fidelity,
the configuration that matters (scale, WAN, backend, congestion control), failures with their
reasons, and the figures. Written to RUN_DIR/report.md; its path is printed.
"""

import pathlib

from testbed import analysis, ownership, plot, rundir
from testbed.errors import ConfigError


def register(sub):
    p = sub.add_parser("report", help="write a Markdown report of a run directory")
    p.add_argument("run_dir", help="a run directory (or an experiment's top directory)")
    p.set_defaults(func=main)


def _fmt(v, spec="{:.3g}"):
    if v is None:
        return "-"
    return spec.format(v) if isinstance(v, (int, float)) else str(v)


def _run_section(d, s):
    meta = rundir.metadata(d)
    scale = rundir.scale(d)
    cfg = meta.get("shaping", {}).get("emulated", {}).get("kv", {})
    lines = [f"### {s['label']}", "",
             f"- run `{d}` (git {meta.get('git_revision', '?')}, kernel {meta.get('kernel', '?')})",
             f"- scale: time x{_fmt(scale.time)}, bytes x{_fmt(scale.bytes)}; "
             f"emulated WAN (KV direction): {_fmt(cfg.get('rate'))} bit/s, delay "
             f"{_fmt(cfg.get('delay'))} s, loss {_fmt(cfg.get('loss'))}",
             f"- shaping backend: {meta.get('shaping', {}).get('backend', '?')} "
             f"({meta.get('shaping', {}).get('reason', '')})",
             f"- TCP: {meta.get('tcp', {})}"]
    fid = meta.get("link_fidelity") or {}
    if "measured" in fid:
        m = fid["measured"]
        lines.append(f"- link as measured: goodput {_fmt(m.get('goodput_bps'))} bit/s, RTT p50 "
                     f"{_fmt(m.get('rtt_p50_ms'))} ms, p99 {_fmt(m.get('rtt_p99_ms'))} ms, jitter "
                     f"{_fmt(m.get('jitter_ms'))} ms, loss {_fmt(m.get('loss'))}"
                     + (f" (probed in run {fid['measured_in']}, the same WAN)"
                        if fid.get("shared") else ""))
    elif fid:
        lines.append(f"- link probe: {fid}")
    emu = s.get("emulation") or {}
    if emu:
        lines.append(f"- emulation timing: decode step x{_fmt(emu.get('decode_step_ratio'))}, "
                     f"prefill x{_fmt(emu.get('prefill_ratio'))} of the profile; first-token lag "
                     f"{_fmt(emu.get('first_token_lag_ms'))} ms")
    if s.get("incomplete"):
        lines.append(f"- **incomplete run**: {s.get('incomplete_reason')}; "
                     f"{s.get('not_finished', 0)} requests sent but not finished, "
                     f"{s.get('not_sent', 0)} never sent (all counted as failed)")
    for w in s.get("warnings") or []:
        if not w.startswith("incomplete run:"):
            lines.append(f"- **warning**: {w}")
    lines += [f"- note: {n}" for n in s.get("link_notes") or []]
    if s.get("failed"):
        lines.append(f"- failed requests: {s['failed']}: {s.get('failure_reasons')}")
    return lines + [""]


def main(args):
    top = pathlib.Path(args.run_dir)
    runs = rundir.find_runs(top)
    if not runs:
        raise ConfigError("no summary.json here or one level below: not a run directory (a "
                          "killed run: `testbed analyse` it first)", path=str(top))
    summaries = [rundir.summary(d) for d in runs]
    name = rundir.metadata(runs[0]).get("name", top.name)
    out = [f"# {name}", "", "Real-world units. `steady` = completions per second between the 10th "
           "and 90th percentile completion; predictions are the planner's Lambda_max for each "
           "configuration (paper form, and with expected prefill latency).", "", "```",
           analysis.table(summaries), "```", ""]
    out += ["## Runs", ""]
    for d, s in zip(runs, summaries):
        out += _run_section(d, s)
    path = rundir.RunDir(top).report
    figures_dir = rundir.RunDir(top).figures
    try:
        figures = sorted(figures_dir.glob("*.png")) if figures_dir.is_dir() else []
        if not figures:
            figures = plot.run_figures(top)
        if figures:
            out += ["## Figures", ""] + [f"![{p.stem}]({rundir.RunDir.FIGURES}/{p.name})" for p in figures] + [""]
        path.write_text("\n".join(out))
    finally:    # under sudo, what this wrote goes to the invoking user
        ownership.hand_back(figures_dir)
        ownership.hand_back(path, recursive=False)
    print(path)
    return 0
