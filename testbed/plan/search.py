"""Model inputs of one experiment, evaluation on threshold and split grids, and the search for
each policy's best configuration (the paper's exhaustive grid search).

Part of `testbed.plan`: `predict(exp)` evaluates one experiment as configured; `testbed.commands.plan.plan_file(path)`
builds the three policies of PRFAAS.md from one experiment file and finds each one's best
threshold and N_p/N_d split.
"""

import dataclasses
import functools
import math
import pathlib

import numpy as np

from testbed import profile as profiles
from testbed.errors import ConfigError, TestbedError
from testbed.plan.equations import (B_out_min, Phi_kv, Theta_pdd, Theta_pdp, Theta_prfaas,
                                    share_bound)
from testbed.plan.lengths import LengthDistribution, input_distribution, mean_output_length

POLICIES = ("prfaas", "homogeneous", "naive")
LATENCY_MODES = ("paper", "expected")
DEFAULT_LATENCY = "paper"
STAGES = ("prfaas", "pdp", "pdd")
GBPS = 1e9                      # the paper's Gbps: 1e9 bit/s
DEFAULT_STEP_TOKENS = 32        # threshold grid step; the issue asks for <= 100
TIE_RTOL = 1e-9                 # Lambda_max values this close count as equal (decode plateau)

ROW_KEYS = ("policy", "threshold", "n_prfaas", "n_p", "n_d", "lambda_max", "theta_prfaas",
            "theta_pdp", "theta_pdd", "offload_fraction", "l_long", "l_short", "egress_gbps",
            "binding", "bound_prfaas", "bound_pdp", "bound_pdd", "prfaas_limit",
            "b_out_min_gbps", "balance")
# What each latency mode reports of one configuration (the nested `paper` / `expected` dicts).
MODE_KEYS = ("lambda_max", "theta_prfaas", "theta_pdp", "theta_pdd", "bound_prfaas",
             "bound_pdp", "bound_pdd", "binding", "egress_gbps")


# ---------------------------------------------------------------- inputs of one evaluation

@functools.lru_cache(maxsize=8)
def _profile(name):
    return profiles.load(name)


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """Everything the model needs besides instance counts and the threshold."""

    profile: object                 # testbed.profile.Profile
    remote: str                     # PrfaaS accelerator
    local: str                      # local PD accelerator
    lengths: LengthDistribution     # L
    l_out: float                    # L_out
    t_decode_s: float               # T_decode
    bs_max: int                     # BS_max
    b_out_Bps: float                # B_out
    wan_rate_bps: float             # the WAN's kv-direction rate (for the warnings)

    def t_remote(self, l):
        return self.profile.t_prefill(self.remote, l)

    def t_local(self, l):
        return self.profile.t_prefill(self.local, l)

    def s_kv(self, l):
        return self.profile.s_kv(l)


def wan_kv_rate_bps(exp):
    """Rate of the WAN direction that carries KV (PrfaaS -> local), bit/s, real-world."""
    return float(exp.network.wan.direction("kv")["rate"])


def inputs_for(exp, lengths=None, b_out_bps=None, base_dir=None, output_lengths=None):
    """Model inputs of one experiment; B_out defaults to the WAN kv rate (module docstring).

    `lengths` / `output_lengths` (arrays) replace the workload's input / output lengths (a
    run's measured ones: then no request list is generated); `base_dir` (the experiment file's
    folder) resolves a relative trace path."""
    prof = _profile(exp.model.profile)
    wan = wan_kv_rate_bps(exp)
    dist = input_distribution(exp, lengths, base_dir)
    l_out = mean_output_length(exp, base_dir, output_lengths)
    decode = exp.decode_model()
    return Inputs(
        profile=prof,
        remote=exp.clusters.prfaas.accelerator,
        local=exp.clusters.local.accelerator,
        lengths=dist,
        l_out=l_out,
        # A full batch at the mean context a request holds while it decodes (input + half its
        # output): T_decode exactly when that is the profile's reference context.
        t_decode_s=decode.step_time(decode.bs_max, decode.bs_max * (dist.mean + l_out / 2)),
        bs_max=decode.bs_max,
        b_out_Bps=(wan if b_out_bps is None else float(b_out_bps)) / 8.0,
        wan_rate_bps=wan,
    )


# ---------------------------------------------------------------- evaluation on grids

def check_latency(latency):
    """The latency mode, or ConfigError (exit code 2) naming the modes there are."""
    if latency not in LATENCY_MODES:
        raise ConfigError(f"latency mode must be one of {', '.join(LATENCY_MODES)}, got "
                          f"{latency!r}", key="latency")
    return latency


def _paper_costs(inp, l_long, l_short):
    # Undefined lengths (an empty side of the threshold) get a placeholder: that stage has no
    # share, so share_bound makes it no bound; its Theta is reported as null later.
    ll = np.where(np.isfinite(l_long), l_long, inp.lengths.mean)
    ls = np.where(np.isfinite(l_short), l_short, inp.lengths.mean)
    return {"t_remote": inp.t_remote(ll), "t_local": inp.t_local(ls), "s_kv_long": inp.s_kv(ll)}


def _expected_costs(inp, t):
    d = inp.lengths

    def mean_of(f, side):
        v = d.expect(f, t)[side]
        # Same placeholder rule as the paper form: an empty side is no bound.
        return np.where(np.isfinite(v), v, float(np.sum(d.probs * f(d.values))))

    return {"t_remote": mean_of(inp.t_remote, 0), "t_local": mean_of(inp.t_local, 1),
            "s_kv_long": mean_of(inp.s_kv, 0)}


def split(inp, t, latency=DEFAULT_LATENCY):
    """Length statistics and per-request stage costs at threshold(s) t, as a dict.

    p, l_long, l_short as `LengthDistribution.split`; the costs the stage throughputs divide by:
    `t_remote` (one PrfaaS prefill), `t_local` (one PD prefill), `s_kv_long` (the KV bytes one
    offloaded request sends); `paper`: each at the conditional mean length, `expected`: its
    conditional mean. t = -inf offloads everything (naive), t = +inf nothing (homogeneous)."""
    check_latency(latency)
    t = np.asarray(t, dtype=float)
    p, l_long, l_short = inp.lengths.split(t)
    costs = _paper_costs(inp, l_long, l_short) if latency == "paper" else \
        _expected_costs(inp, t)
    return dict(costs, p=p, l_long=l_long, l_short=l_short)


def _row_vector(sp):
    """The arrays of `split` over thresholds, shaped for a (splits x thresholds) grid."""
    return {k: np.asarray(v)[None, :] for k, v in sp.items()}


def evaluate(inp, n_prfaas, n_p, n_d, p, l_long, l_short, costs=None):
    """All stage quantities for (broadcastable arrays of) counts and length statistics.

    `costs` ({t_remote, t_local, s_kv_long}, from `split`) sets what the stage throughputs
    divide by; without it they are the paper's, at l_long and l_short."""
    p = np.asarray(p, dtype=float)
    if costs is None:
        costs = _paper_costs(inp, l_long, l_short)
    t_remote, t_local, s_kv_long = costs["t_remote"], costs["t_local"], costs["s_kv_long"]
    theta_prfaas = Theta_prfaas(n_prfaas, t_remote, s_kv_long, inp.b_out_Bps)
    theta_pdp = Theta_pdp(n_p, t_local)
    theta_pdd = Theta_pdd(n_d, inp.bs_max, inp.t_decode_s, inp.l_out)
    bound_prfaas = share_bound(theta_prfaas, p)
    bound_pdp = share_bound(theta_pdp, 1.0 - p)
    bound_pdd = np.broadcast_to(theta_pdd, np.broadcast(bound_prfaas, bound_pdp).shape)
    lam = np.minimum(np.minimum(bound_prfaas, bound_pdp), bound_pdd)
    egress_Bps = np.where(p > 0, lam * p * s_kv_long, 0.0)
    return {
        "lambda_max": lam, "theta_prfaas": theta_prfaas, "theta_pdp": theta_pdp,
        "theta_pdd": theta_pdd, "bound_prfaas": bound_prfaas, "bound_pdp": bound_pdp,
        "bound_pdd": bound_pdd, "egress_Bps": egress_Bps, "p": p,
        "prfaas_bandwidth_bound": n_prfaas / t_remote > inp.b_out_Bps / s_kv_long,
        "b_out_min_Bps": B_out_min(n_prfaas, Phi_kv(s_kv_long, t_remote)),
    }


def _num(x, digits=None):
    """JSON-safe float: nan and inf become None."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return round(x, digits) if digits is not None else x


def _row(policy, inp, q, idx, threshold, n_prfaas, n_p, n_d, l_long, l_short):
    """The reported dict of one configuration, picked at index `idx` of the arrays in `q`."""
    at = lambda name: np.broadcast_to(q[name], q["lambda_max"].shape)[idx]   # noqa: E731
    p = float(np.broadcast_to(q["p"], q["lambda_max"].shape)[idx])
    bounds = {s: float(at(f"bound_{s}")) for s in STAGES}
    binding = min(STAGES, key=lambda s: bounds[s])
    has_remote = n_prfaas > 0 and p > 0
    has_local = n_p > 0 and p < 1
    theta_prfaas = float(at("theta_prfaas")) if has_remote else (0.0 if n_prfaas == 0 else None)
    theta_pdp = float(at("theta_pdp")) if has_local else (0.0 if n_p == 0 else None)
    theta_pdd = float(at("theta_pdd"))
    producers = (theta_prfaas or 0.0) + (theta_pdp or 0.0)
    return {
        "policy": policy,
        "threshold": None if threshold is None else int(threshold),
        "n_prfaas": int(n_prfaas), "n_p": int(n_p), "n_d": int(n_d),
        "lambda_max": _num(at("lambda_max")),
        "theta_prfaas": _num(theta_prfaas) if theta_prfaas is not None else None,
        "theta_pdp": _num(theta_pdp) if theta_pdp is not None else None,
        "theta_pdd": _num(theta_pdd),
        "offload_fraction": p,
        "l_long": _num(l_long) if p > 0 else None,
        "l_short": _num(l_short) if p < 1 else None,
        "egress_gbps": float(at("egress_Bps")) * 8 / GBPS,
        "binding": binding,
        "bound_prfaas": _num(bounds["prfaas"]), "bound_pdp": _num(bounds["pdp"]),
        "bound_pdd": _num(bounds["pdd"]),
        "prfaas_limit": ("bandwidth" if bool(at("prfaas_bandwidth_bound")) else "compute")
        if has_remote else None,
        "b_out_min_gbps": float(at("b_out_min_Bps")) * 8 / GBPS if has_remote else None,
        # (Theta_prfaas + Theta_pdp) / Theta_pdd: the paper's long-timescale signal
        # (<< 1 prefill-bound, >> 1 decode-bound).
        "balance": _num(producers / theta_pdd) if theta_pdd > 0 else None,
    }


def _pick(lam, egress):
    """Index of the best configuration: highest Lambda_max; among equals, least egress."""
    lam = np.where(np.isfinite(lam), lam, -np.inf)
    best = lam.max()
    tied = lam >= best * (1 - TIE_RTOL) if best > 0 else lam >= best
    cost = np.where(tied, egress, np.inf)
    return np.unravel_index(int(np.argmin(cost)), lam.shape)


def threshold_grid(lengths, step=DEFAULT_STEP_TOKENS):
    """Thresholds t from the shortest length up to the longest, every `step` tokens.

    t = max would offload nothing (that is homogeneous PD), so the grid stops below it."""
    if not 0 < step <= 100:
        raise ConfigError(f"threshold step must be in (0, 100] tokens, got {step}", key="step")
    lo, hi = math.floor(lengths.min), math.ceil(lengths.max)
    ts = np.arange(lo, hi, step, dtype=float)
    return ts if ts.size else np.array([float(lo)])


def best_prfaas(inp, n_prfaas, n_local, step=DEFAULT_STEP_TOKENS, latency=DEFAULT_LATENCY):
    """PrfaaS-PD: exhaustive grid over t x every split N_p + N_d = n_local (both >= 1)."""
    if n_prfaas < 1 or n_local < 2:
        return None
    ts = threshold_grid(inp.lengths, step)
    sp = split(inp, ts, latency)
    g = _row_vector(sp)
    n_p = np.arange(1, n_local, dtype=float)[:, None]         # splits x thresholds
    q = evaluate(inp, n_prfaas, n_p, n_local - n_p, g["p"], g["l_long"], g["l_short"], g)
    s, k = _pick(q["lambda_max"], q["egress_Bps"])
    return _row("prfaas", inp, q, (s, k), ts[k], n_prfaas, int(n_p[s, 0]),
                n_local - int(n_p[s, 0]), sp["l_long"][k], sp["l_short"][k])


def best_homogeneous(inp, n_local, latency=DEFAULT_LATENCY):
    """Homogeneous PD: p = 0, local instances only, best split N_p + N_d = n_local."""
    if n_local < 2:
        return None
    n_p = np.arange(1, n_local, dtype=float)
    sp = split(inp, _policy_threshold("homogeneous", None), latency)
    q = evaluate(inp, 0, n_p, n_local - n_p, sp["p"], sp["l_long"], sp["l_short"], sp)
    (s,) = _pick(q["lambda_max"], q["egress_Bps"])
    return _row("homogeneous", inp, q, (s,), None, 0, int(n_p[s]), n_local - int(n_p[s]),
                sp["l_long"], sp["l_short"])


def naive(inp, n_prfaas, n_local, latency=DEFAULT_LATENCY):
    """Naive heterogeneous: p = 1, every prefill on PrfaaS, every local instance decodes."""
    if n_prfaas < 1 or n_local < 1:
        return None
    return evaluate_config(inp, "naive", None, n_prfaas, 0, n_local, latency)


def _policy_threshold(policy, threshold):
    """The threshold `split` takes for a policy: homogeneous offloads nothing, naive all."""
    return {"homogeneous": np.inf, "naive": -np.inf}.get(policy, threshold)


def evaluate_config(inp, policy, threshold, n_prfaas, n_p, n_d, latency=DEFAULT_LATENCY):
    """The reported row of ONE configuration (no search) in one latency mode."""
    sp = split(inp, _policy_threshold(policy, threshold), latency)
    q = evaluate(inp, n_prfaas, np.full(1, float(n_p)), np.full(1, float(n_d)), sp["p"],
                 sp["l_long"], sp["l_short"], sp)
    return _row(policy, inp, q, (0,), threshold, n_prfaas, n_p, n_d, sp["l_long"],
                sp["l_short"])


def with_both_modes(row, inp, latency):
    """A row (computed in `latency`) plus both modes' evaluation of its configuration:
    `lambda_max_paper`, `lambda_max_expected` and the nested dicts `paper`, `expected`."""
    both = {mode: row if mode == latency else evaluate_config(
        inp, row["policy"], row["threshold"], row["n_prfaas"], row["n_p"], row["n_d"], mode)
        for mode in LATENCY_MODES}
    row["latency"] = latency
    row.update({f"lambda_max_{mode}": r["lambda_max"] for mode, r in both.items()})
    row.update({mode: {k: r[k] for k in MODE_KEYS} for mode, r in both.items()})
    return row


# ---------------------------------------------------------------- one experiment as configured

def _configured(exp, inp, latency=DEFAULT_LATENCY):
    c, pol = exp.clusters, exp.scheduler.policy
    n_prfaas = 0 if pol == "homogeneous" else c.prfaas.instances
    t = exp.scheduler.threshold if pol == "prfaas" else None
    return evaluate_config(inp, pol, t, n_prfaas, c.local.prefill, c.local.decode, latency)


def predict(exp, lengths=None, b_out_bps=None, base_dir=None, latency=DEFAULT_LATENCY,
            output_lengths=None):
    """The model's prediction for ONE experiment as configured (no optimisation).

    Returns the same keys as each policy of `plan_file` (ROW_KEYS) in the `latency` mode (the
    paper's form by default, so `lambda_max` is the paper's prediction), in real-world units
    (lambda_max in requests/s), plus `latency`, both modes side by side (`lambda_max_paper`,
    `lambda_max_expected`, and `paper` / `expected`: dicts of MODE_KEYS), `b_out_gbps` and
    `warnings`. Never raises for a validated experiment: what cannot be predicted comes back
    as None with the reason in `warnings`."""
    check_latency(latency)
    try:
        inp = inputs_for(exp, lengths, b_out_bps, base_dir, output_lengths)
        row = with_both_modes(_configured(exp, inp, latency), inp, latency)
    except (TestbedError, ValueError) as e:
        row = {k: None for k in ROW_KEYS}
        row.update(policy=exp.scheduler.policy, latency=latency, b_out_gbps=None,
                   warnings=[str(e)])
        for mode in LATENCY_MODES:
            row[mode] = {k: None for k in MODE_KEYS}
            row[f"lambda_max_{mode}"] = None
        return row
    row["b_out_gbps"] = inp.b_out_Bps * 8 / GBPS
    row["warnings"] = egress_warnings(row, inp)
    return row


# ---------------------------------------------------------------- the three policies of a file

@dataclasses.dataclass(frozen=True)
class PolicySizing:
    """Cluster sizes the planner gives one policy, and where they came from."""

    policy: str
    exp: object                 # the Experiment whose workload, model and network are used
    n_prfaas: int
    n_local: int
    origin: str


def policy_sizings(runs):
    """One PolicySizing per policy (None where it cannot be derived), and warnings.

    Rule: a run (variant) whose scheduler.policy matches gives that policy's cluster sizes
    (its N_p/N_d split is re-optimised; only the totals are used). A policy without a run is
    derived from the base run (the first prfaas run, else the first run) as in the paper's case
    study: homogeneous gets N_prfaas + N_local local instances of the local accelerator (4 + 8 =
    12 H20), naive keeps the PrfaaS cluster and makes every local instance decode."""
    warnings = []
    by_policy = {}
    for exp in runs:
        pol = exp.scheduler.policy
        if pol in by_policy:
            if by_policy[pol][1] == 1:
                warnings.append(f"several runs with policy {pol}: planning the first "
                                f"({by_policy[pol][0].run_label})")
            by_policy[pol] = (by_policy[pol][0], by_policy[pol][1] + 1)
        else:
            by_policy[pol] = (exp, 1)
    base = by_policy["prfaas"][0] if "prfaas" in by_policy else runs[0]
    bc = base.clusters
    out = {}
    for pol in POLICIES:
        if pol in by_policy:
            exp = by_policy[pol][0]
            c = exp.clusters
            n_prfaas = 0 if pol == "homogeneous" else c.prfaas.instances
            out[pol] = PolicySizing(pol, exp, n_prfaas, c.local.instances,
                                    f"run {exp.run_label!r}")
        elif pol == "homogeneous":
            out[pol] = PolicySizing(pol, base, 0, bc.prfaas.instances + bc.local.instances,
                                    f"derived from run {base.run_label!r}: "
                                    f"{bc.prfaas.instances} + {bc.local.instances} local")
        elif bc.prfaas.instances >= 1:
            out[pol] = PolicySizing(pol, base, bc.prfaas.instances, bc.local.instances,
                                    f"derived from run {base.run_label!r}")
        else:
            out[pol] = None
            warnings.append(f"no {pol} run and the base run has no PrfaaS instances: "
                            f"{pol} is not planned")
    return out, warnings


def egress_warnings(row, inp):
    """The B_out checks of the module docstring, as one-line messages."""
    out = []
    if row is None or not row.get("egress_gbps"):
        return out
    wan = inp.wan_rate_bps / GBPS
    if row["egress_gbps"] > wan * (1 + 1e-9):
        out.append(f"{row['policy']}: predicted PrfaaS egress {row['egress_gbps']:.2f} Gbps "
                   f"exceeds the WAN rate {wan:.3g} Gbps (B_out {inp.b_out_Bps * 8 / GBPS:.3g} "
                   f"Gbps is above the link)")
    need = row.get("b_out_min_gbps")
    b_out = inp.b_out_Bps * 8 / GBPS
    if need is not None and need > b_out * (1 + 1e-9):
        out.append(f"{row['policy']}: PrfaaS needs B_out >= N_prfaas * Phi_kv(l_long) = "
                   f"{need:.2f} Gbps to stay compute-bound; B_out is {b_out:.3g} Gbps (WAN "
                   f"{wan:.3g} Gbps), so it is bandwidth-bound")
    return out


PHI_KV_LENGTHS = (1024, 8192, 32768, 131072)


def phi_kv_table(inp, extra=()):
    """Phi_kv (Gbps) of one instance of each accelerator at the paper's lengths (and extra)."""
    ls = sorted(set(PHI_KV_LENGTHS) | {int(round(x)) for x in extra if x})
    return {acc: {str(l): float(inp.profile.phi_kv(acc, l)) * 8 / GBPS for l in ls}
            for acc in dict.fromkeys((inp.remote, inp.local))}


def _best(policy, inp, sz, step, latency):
    if policy == "prfaas":
        return best_prfaas(inp, sz.n_prfaas, sz.n_local, step, latency)
    if policy == "homogeneous":
        return best_homogeneous(inp, sz.n_local, latency)
    return naive(inp, sz.n_prfaas, sz.n_local, latency)


SUMMARY_KEYS = ("threshold", "n_p", "n_d", "lambda_max", "binding")


def plan_runs(runs, lengths=None, b_out_bps=None, step=DEFAULT_STEP_TOKENS, base_dir=None,
              latency=DEFAULT_LATENCY):
    """The planner's report for the runs of one experiment file (see `plan_file`).

    `policies` and `ratios` are the optima of the `latency` mode; `by_latency` gives every
    mode's own optimum (SUMMARY_KEYS) and ratios, so both predictions sit side by side."""
    check_latency(latency)
    sizings, warnings = policy_sizings(runs)
    by_mode = {mode: {} for mode in LATENCY_MODES}
    inputs = {}
    for pol, sz in sizings.items():
        if sz is None:
            for mode in LATENCY_MODES:
                by_mode[mode][pol] = None
            continue
        inp = inputs_for(sz.exp, lengths, b_out_bps, base_dir)
        inputs[pol] = inp
        for mode in LATENCY_MODES:
            row = _best(pol, inp, sz, step, mode)
            if row is not None:
                row = with_both_modes(row, inp, mode)
                row["origin"] = sz.origin
            by_mode[mode][pol] = row
        row = by_mode[latency][pol]
        if row is None:
            warnings.append(f"{pol}: {sz.n_prfaas} PrfaaS + {sz.n_local} local instances "
                            f"cannot run this policy")
        else:
            warnings.extend(egress_warnings(row, inp))
    policies = by_mode[latency]
    ref = inputs.get("prfaas") or next(iter(inputs.values()))
    l_long = (policies.get("prfaas") or {}).get("l_long")
    return {
        "latency": latency,
        "policies": policies,
        "ratios": _ratios(policies),
        "by_latency": {mode: {
            "policies": {pol: None if row is None else {k: row[k] for k in SUMMARY_KEYS}
                         for pol, row in rows.items()},
            "ratios": _ratios(rows)} for mode, rows in by_mode.items()},
        "phi_kv": {"unit": "Gbps per instance",
                   "by_accelerator": phi_kv_table(ref, [l_long] if l_long else [])},
        "b_out_gbps": ref.b_out_Bps * 8 / GBPS,
        "b_out_rule": "WAN kv-direction rate" if b_out_bps is None else "set by the caller",
        "wan_gbps": ref.wan_rate_bps / GBPS,
        "inputs": {"profile": ref.profile.name, "input": ref.lengths.label,
                   "mean_input": ref.lengths.mean, "l_out": ref.l_out,
                   "t_decode_s": ref.t_decode_s, "bs_max": ref.bs_max,
                   "threshold_step": step},
        "configured": [dict(predict(exp, lengths, b_out_bps, base_dir, latency),
                            label=exp.run_label) for exp in runs],
        "warnings": warnings,
    }


def _ratios(policies):
    lam = {k: (v or {}).get("lambda_max") for k, v in policies.items()}
    out = {}
    for other in ("homogeneous", "naive"):
        if lam.get("prfaas") and lam.get(other):
            out[f"prfaas/{other}"] = lam["prfaas"] / lam[other]
    return out


__all__ = ["Phi_kv", "B_out_min", "Theta_prfaas", "Theta_pdp", "Theta_pdd",
           "LengthDistribution", "Inputs", "inputs_for", "evaluate", "best_prfaas",
           "best_homogeneous", "naive", "predict", "plan_runs", "policy_sizings",
           "split", "evaluate_config", "with_both_modes", "ROW_KEYS", "MODE_KEYS", "POLICIES",
           "LATENCY_MODES", "DEFAULT_LATENCY", "DEFAULT_STEP_TOKENS"]
