"""`testbed plan FILE`: what the paper's analytical model predicts for an experiment file.

Builds the three deployments of PRFAAS.md (PrfaaS-PD, homogeneous PD, naive heterogeneous) from
the file's runs (`testbed.plan.policy_sizings` states the rule), finds each one's best threshold
and N_p/N_d split, and prints a table per policy with the headline ratios, or (`--json`) one
object `{"policies": {"prfaas": {...}, "homogeneous": {...}, "naive": {...}}, ...}`.
`--latency paper|expected` chooses what the stage throughputs divide by (`testbed.plan`:
T_prefill at the conditional mean length, the paper's form, or the conditional mean of
T_prefill); the output shows both modes' Lambda_max and headline ratios either way.
`--figures DIR` also draws the planner's figures (`testbed.plan_figures`). Nothing is started.
"""

import argparse
import json
import math
import pathlib

import numpy as np

from testbed import plan as planner
from testbed import units
from testbed import deploy
from testbed.errors import ConfigError
from testbed.workload.generate import generate


def register(subparsers):
    p = subparsers.add_parser(
        "plan", help="predict throughput of the three policies with the paper's model",
        description="Predict Lambda_max of PrfaaS-PD, homogeneous PD and naive heterogeneous "
                    "for an experiment file with the paper's analytical model (real-world units).")
    p.add_argument("file", help="experiment YAML (its variants give each policy's cluster sizes)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a key of the file (dotted path), e.g. network.wan.rate=50Gbit")
    p.add_argument("--figures", metavar="DIR", help="also write the planner's figures (PNG, PDF)")
    p.add_argument("--b-out", metavar="RATE", type=_rate, default=None,
                   help="PrfaaS egress bandwidth B_out, e.g. 40Gbit (default: the WAN kv rate)")
    p.add_argument("--step", metavar="TOKENS", type=int, default=planner.DEFAULT_STEP_TOKENS,
                   help=f"threshold grid step (1..100, default {planner.DEFAULT_STEP_TOKENS})")
    p.add_argument("--lengths", metavar="FILE",
                   help="empirical uncached input lengths, one integer a line (replaces the "
                        "file's input distribution)")
    p.add_argument("--latency", choices=planner.LATENCY_MODES, default=planner.DEFAULT_LATENCY,
                   help="stage throughputs from T_prefill at the conditional mean length "
                        "(paper, the default) or from the conditional mean of T_prefill "
                        "(expected); both modes are printed either way")
    p.add_argument("--ttft", action="store_true",
                   help="also predict TTFT (mean, p50, p90) of each configured run at offered "
                        "loads, as fractions of its Lambda_max (E[T] form): testbed/plan/ttft.py")
    p.add_argument("--loads", metavar="F,F,...", type=_fractions, default=DEFAULT_LOADS,
                   help="with --ttft: the offered loads as fractions of Lambda_max (default "
                        + ",".join(f"{f:g}" for f in DEFAULT_LOADS) + ")")
    p.set_defaults(func=run)
    return p


DEFAULT_LOADS = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9)


def _fractions(text):
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions like 0.2,0.5, got {text!r}") from None
    if not out or any(not (0 < f < 5) for f in out):
        raise argparse.ArgumentTypeError("each load must be a fraction of Lambda_max in (0, 5)")
    return out


def _rate(text):
    try:
        return units.rate_bps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


MAX_LENGTHS_FILE_BYTES = 64 << 20
MAX_LENGTH_TOKENS = 10_000_000


def read_lengths(path):
    """Lengths from a text file, one number of tokens a line ('#' comments and blank lines
    allowed); any other line is an error naming its line number."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError("no such lengths file", path=str(path))
    if p.stat().st_size > MAX_LENGTHS_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_LENGTHS_FILE_BYTES >> 20} MiB", path=str(path))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError("not a UTF-8 text file", path=str(path)) from None
    values = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            v = float(line)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and 0 <= v <= MAX_LENGTH_TOKENS):
            raise ConfigError(f"line {n}: expected one length in tokens (0 to "
                              f"{MAX_LENGTH_TOKENS:,}), got {line[:40]!r}", path=str(path))
        values.append(v)
    if not values:
        raise ConfigError("no lengths in the file", path=str(path))
    return planner.LengthDistribution.from_lengths(np.array(values), label=p.name)


def plan_file(path, overrides=(), lengths=None, b_out_bps=None, step=planner.DEFAULT_STEP_TOKENS,
              latency=planner.DEFAULT_LATENCY):
    """Plan the three policies of one experiment file (`testbed plan FILE`)."""
    runs = [exp for exp, _ in deploy.load(path, overrides)]   # refused as `run` would
    return planner.plan_runs(runs, lengths, b_out_bps, step,
                             base_dir=str(pathlib.Path(path).resolve().parent), latency=latency)


def run(args):
    lengths = read_lengths(args.lengths) if args.lengths else None
    report = plan_file(args.file, args.overrides, lengths=lengths, b_out_bps=args.b_out,
                               step=args.step, latency=args.latency)
    if args.figures:
        from testbed import plan_figures   # matplotlib: only when figures are asked for
        runs = [exp for exp, _ in deploy.load(args.file, args.overrides)]
        report["figures"] = [str(f) for f in plan_figures.draw_all(
            runs, args.figures, lengths=lengths, b_out_bps=args.b_out, step=args.step,
            latency=args.latency)]
    if args.ttft:
        report["ttft"] = ttft_table([exp for exp, _ in deploy.load(args.file, args.overrides)],
                                    args.loads, lengths,
                                    base_dir=str(pathlib.Path(args.file).resolve().parent))
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
    else:
        print(render(report, args.file))
        if args.ttft:
            print("\n" + render_ttft(report["ttft"]))
    return 0


def ttft_table(runs, loads, lengths=None, base_dir=None):
    """The TTFT model for each configured run at each load (a fraction of the run's own
    Lambda_max in the E[T] form), with the burstiness (C_a^2) of the run's request list."""
    rows = []
    for exp in runs:
        inp = planner.inputs_for(exp, lengths, base_dir=base_dir)
        lam = planner.predict(exp, lengths=lengths, base_dir=base_dir,
                              latency="expected")["lambda_max"]
        arrivals = generate(exp.workload, exp.seed, requests=exp.requests,
                            duration_s=exp.duration, base_dir=base_dir).arrival_s.to_numpy()
        for f in loads:
            p = planner.predict_ttft_for(exp, inp, arrivals, rate=f * lam) if lam else {}
            rows.append({"label": exp.run_label, "policy": exp.scheduler.policy, "load": f,
                         "rate": f * lam if lam else None, "lambda_max_expected": lam,
                         **{k: p.get(k) for k in ("mean_ttft_ms", "median_ttft_ms",
                                                  "p90_ttft_ms", "p99_ttft_ms")},
                         "arrival_scv": p.get("arrival_scv"),
                         "saturated": p.get("saturated", [])})
    return rows


def render_ttft(rows):
    out = ["TTFT model (testbed/plan/ttft.py: " + planner.TTFT_APPROXIMATION + ")",
           "  run               load  req/s    mean ms     p50 ms     p90 ms  saturated"]
    for r in rows:
        cells = ["-" if r[k] is None else f"{r[k]:.0f}"
                 for k in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms")]
        rate = "-" if r["rate"] is None else f"{r['rate']:.3f}"
        out.append(f"  {r['label'][:16]:16s}  {r['load']:4.2f}  {rate:>5s}  "
                   + "  ".join(c.rjust(9) for c in cells) + "  " + ",".join(r["saturated"]))
    return "\n".join(out)


# ---------------------------------------------------------------- human output

_LINES = [  # (label, key, format)
    ("PrfaaS instances", "n_prfaas", "{:d}"),
    ("N_p (local prefill)", "n_p", "{:d}"),
    ("N_d (local decode)", "n_d", "{:d}"),
    ("threshold t (tokens)", "threshold", "{:,d}"),
    ("p = P(L > t)", "offload_fraction", "{:.3f}"),
    ("l_long (tokens)", "l_long", "{:,.0f}"),
    ("l_short (tokens)", "l_short", "{:,.0f}"),
    ("Theta_prfaas (req/s)", "theta_prfaas", "{:.3f}"),
    ("Theta_pdp (req/s)", "theta_pdp", "{:.3f}"),
    ("Theta_pdd (req/s)", "theta_pdd", "{:.3f}"),
    ("Theta_prfaas / p", "bound_prfaas", "{:.3f}"),
    ("Theta_pdp / (1 - p)", "bound_pdp", "{:.3f}"),
    ("Lambda_max (req/s)", "lambda_max", "{:.3f}"),
    ("  paper form, this config", "lambda_max_paper", "{:.3f}"),
    ("  expected, this config", "lambda_max_expected", "{:.3f}"),
    ("binding stage", "binding", "{}"),
    ("PrfaaS limited by", "prfaas_limit", "{}"),
    ("egress (Gbps)", "egress_gbps", "{:.2f}"),
    ("B_out needed (Gbps)", "b_out_min_gbps", "{:.2f}"),
    ("(Th_prfaas+Th_pdp)/Th_pdd", "balance", "{:.2f}"),
]


def _cell(row, key, fmt):
    if row is None:
        return "-"
    v = row.get(key)
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


def render(report, path):
    pols = report["policies"]
    inp = report["inputs"]
    names = list(pols)
    head = [f"testbed plan {path}",
            f"  model {inp['profile']}; L ~ {inp['input']} (E[L] = {inp['mean_input']:,.0f}); "
            f"L_out = {inp['l_out']:,.0f}; T_decode = {inp['t_decode_s'] * 1e3:g} ms; "
            f"BS_max = {inp['bs_max']}",
            f"  B_out = {report['b_out_gbps']:.3g} Gbps ({report['b_out_rule']}); "
            f"WAN {report['wan_gbps']:.3g} Gbps; threshold grid step {inp['threshold_step']} "
            f"tokens",
            f"  table: optima of latency mode {report['latency']}, "
            f"{_MODE_TEXT[report['latency']]}", ""]
    width = max(len(label) for label, _, _ in _LINES)
    cols = [max(12, len(n)) for n in names]
    lines = ["  " + " " * width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, cols))]
    for label, key, fmt in _LINES:
        cells = [_cell(pols[n], key, fmt) for n in names]
        lines.append("  " + label.ljust(width) + "  " +
                     "  ".join(c.rjust(w) for c, w in zip(cells, cols)))
    origin = [f"  {n}: {pols[n]['origin']}" for n in names if pols[n]]
    by_mode = _by_mode_lines(report, names, width, cols)
    phi_lines = ["Phi_kv per instance (Gbps)"] + [
        f"  {acc}: " + ", ".join(f"{_k(l)} {g:.2f}" for l, g in row.items())
        for acc, row in report["phi_kv"]["by_accelerator"].items()]
    conf = [_configured_line(c) for c in report["configured"]]
    warn = [f"  warning: {w}" for w in report["warnings"]]
    out = head + lines + [""] + by_mode + ["", "sizes from"] + origin + \
        ["", "as configured in the file (what `testbed run` will measure)"] + conf + \
        [""] + phi_lines
    if warn:
        out += [""] + warn
    if report.get("figures"):
        out += ["", "figures: " + ", ".join(report["figures"])]
    return "\n".join(out)


_MODE_TEXT = {"paper": "T_prefill at the conditional mean length (the paper's form)",
              "expected": "conditional mean of T_prefill, E[T(L) | L > t] (Jensen)"}


def _by_mode_lines(report, names, width, cols):
    """Each latency mode's Lambda_max at its own optimum, and its headline ratios."""
    label = "Lambda_max at each mode's optimum"
    lines = [label]
    for mode, res in report["by_latency"].items():
        cells = [_cell(res["policies"].get(n), "lambda_max", "{:.3f}") for n in names]
        lines.append("  " + f"{mode} (req/s)".ljust(width) + "  " +
                     "  ".join(c.rjust(w) for c, w in zip(cells, cols)))
    for mode, res in report["by_latency"].items():
        lines += ["", f"headline, {mode}: {_MODE_TEXT[mode]}"]
        lines += [f"  Lambda_max {k.replace('/', ' / ')} = {v:.2f}x"
                  for k, v in res["ratios"].items()] or ["  -"]
    return lines


def _configured_line(c):
    if c.get("lambda_max") is None:
        return f"  {c['label']}: no prediction"
    both = ", ".join(f"{m} {c[f'lambda_max_{m}']:.3f}" for m in planner.LATENCY_MODES
                     if c.get(f"lambda_max_{m}") is not None)
    return f"  {c['label']}: Lambda_max {both} req/s, binding {c['binding']}"


def _k(l):
    l = int(l)
    return f"{l // 1024}Ki" if l % 1024 == 0 else f"{l / 1024:.1f}Ki"
