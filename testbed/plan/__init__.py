"""Predict: the paper's analytical throughput model, as a planner beside the emulator.

PRFAAS.md ("Analytical model") is the specification; the symbols here are the paper's:

    Phi_kv(l)     = S_kv(l) / T_prefill(l)                       KV throughput of one instance
    B_out         = the egress bandwidth PrfaaS may use          (bytes/s here, Gbps in reports)
    p             = P(L > t);  l_long = E[L | L > t];  l_short = E[L | L <= t]
    Theta_prfaas  = min(N_prfaas / T_prefill_remote(l_long), B_out / S_kv(l_long))
    Theta_pdp     = N_p / T_prefill_local(l_short)
    Theta_pdd     = N_d * BS_max / (T_decode * L_out)
    Lambda_max    = min(Theta_prfaas / p, Theta_pdp / (1 - p), Theta_pdd)

A stage that receives no traffic (p = 0 for PrfaaS, p = 1 for PD prefill) does not bound
Lambda_max. Homogeneous PD is the model with p = 0 and local instances only; naive heterogeneous
is p = 1 with every local instance decoding.

Latency mode (`latency=`, `testbed plan --latency`): what a stage throughput divides by.
- `paper` (default, the formulas above): the latency AT the conditional mean length,
  T_prefill(l_long) and T_prefill(l_short); reproduces the paper's headline numbers.
- `expected`: the conditional mean latency, E[T_prefill(L) | L > t] and E[T_prefill(L) | L <= t]
  (and E[S_kv(L) | L > t] for the egress terms). An instance serving a stream of requests spends
  E[T] per request, so N / E[T] is its capacity; T is convex (quadratic), so by Jensen
  T(E[L]) <= E[T(L)] and the paper form overestimates every prefill stage. S_kv is linear, so
  its two forms agree; Theta_pdd is the same in both (decode time is linear in L_out).
The expectations come from the same probability mass as p and l_long: prefix sums of
pmf * T(l) over the length grid make every threshold O(1) (`LengthDistribution.expect`).

Where this package sits: it reads only validated `Experiment` objects (`testbed.config`) and
profiles (`testbed.profile`, the same fits the workers use), so a prediction and an emulated run of
one file use the same numbers. Everything is real-world: `scale:` does not enter the model.

Modules: `equations` (the formulas above, array-valued), `lengths` (the distributions of L
and L_out), `search` (model inputs of one experiment, grid evaluation, the search for each
policy's best configuration), `curves` (the figures' curves), `ttft` (the TTFT queueing
model) and `finite` (its corrections for one finite run: transient, sample percentiles). Everything public is re-exported here: `plan.predict(exp)`.

- `LengthDistribution` holds the uncached input length L as a probability mass function; p,
  l_long and l_short come from its cumulative sums for a whole vector of thresholds at once.
  Analytic specs are discretised on every integer token count exactly as the workload generator
  rounds them, so the moments are those of the lengths the emulator sends (and within 0.1% of the
  continuous truncated distribution); an empirical distribution is built from an array of lengths.
- `predict(exp)` evaluates ONE experiment as configured (its policy, threshold and split).
- `testbed.commands.plan.plan_file(path)` builds the three policies of PRFAAS.md from one experiment file and finds each
  one's best threshold and N_p/N_d split by exhaustive grid search, as the paper does.

B_out rule: the paper fixes B_out; here it is the WAN rate of the `kv` direction
(`network.wan.kv.rate`, else `network.wan.rate`), because the WAN is the only path PrfaaS egress
takes, so the link rate is the most the cluster can send. A planner argument (`b_out_bps`,
`testbed plan --b-out`) may set another value (a provisioned share of the link, or a what-if
above it); a warning says when the predicted egress exceeds the WAN rate, and when PrfaaS would
need more than B_out to stay compute-bound (`b_out_min = N_prfaas * Phi_kv(l_long)`, the
paper's minimum egress).
"""

# Re-exported: callers use `from testbed import plan; plan.predict(...)`.
from testbed.errors import ConfigError, TestbedError  # noqa: F401
from testbed.plan.equations import (  # noqa: F401
    B_out_min, Lambda_max, Phi_kv, Theta_pdd, Theta_pdp, Theta_prfaas, share_bound)
from testbed.plan.curves import curves_vs_n_p, curves_vs_threshold  # noqa: F401
from testbed.plan.lengths import (  # noqa: F401
    LengthDistribution, distribution_from_spec, input_distribution, mean_output_length,
    uses_request_list)
from testbed.plan.search import (  # noqa: F401
    DEFAULT_LATENCY, DEFAULT_STEP_TOKENS, GBPS, Inputs, LATENCY_MODES, MODE_KEYS, PHI_KV_LENGTHS,
    POLICIES, PolicySizing, ROW_KEYS, STAGES, SUMMARY_KEYS, TIE_RTOL, best_homogeneous,
    best_prfaas, check_latency, egress_warnings, evaluate,
    evaluate_config, inputs_for, naive, phi_kv_table, plan_runs, policy_sizings,
    predict, split, threshold_grid, wan_kv_rate_bps, with_both_modes)
from testbed.plan.ttft import APPROXIMATION as TTFT_APPROXIMATION  # noqa: F401,E402
from testbed.plan.ttft import predict_for as predict_ttft_for  # noqa: F401,E402
