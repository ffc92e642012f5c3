"""Curves for the planner's figures (`testbed.plan_figures`): Lambda_max and the stage bounds
against N_p (each at its best threshold) and against the threshold t at a fixed split.

Part of `testbed.plan` (re-exported there); the same grid evaluation as the search.
"""

import numpy as np

from testbed.plan.search import (DEFAULT_LATENCY, DEFAULT_STEP_TOKENS, _row_vector, evaluate,
                                 split, threshold_grid)


def curves_vs_n_p(inp, n_prfaas, n_local, step=DEFAULT_STEP_TOKENS, latency=DEFAULT_LATENCY):
    """Per N_p (prfaas policy, best t for each): Lambda_max, prefill bound and decode bound."""
    g = _row_vector(split(inp, threshold_grid(inp.lengths, step), latency))
    n_p = np.arange(1, n_local, dtype=float)[:, None]
    q = evaluate(inp, n_prfaas, n_p, n_local - n_p, g["p"], g["l_long"], g["l_short"], g)
    prefill = np.minimum(q["bound_prfaas"], q["bound_pdp"]).max(axis=1)
    return {"n_p": n_p[:, 0].astype(int), "lambda_max": q["lambda_max"].max(axis=1),
            "prefill_bound": prefill, "decode_bound": q["theta_pdd"][:, 0]}


def curves_vs_threshold(inp, n_prfaas, n_p, n_d, step=DEFAULT_STEP_TOKENS,
                        latency=DEFAULT_LATENCY):
    """Per threshold t at a fixed split: the PrfaaS bound, PD-prefill bound, decode bound."""
    ts = threshold_grid(inp.lengths, step)
    sp = split(inp, ts, latency)
    q = evaluate(inp, n_prfaas, n_p, n_d, sp["p"], sp["l_long"], sp["l_short"], sp)
    return {"threshold": ts, "lambda_max": q["lambda_max"], "bound_prfaas": q["bound_prfaas"],
            "bound_pdp": q["bound_pdp"], "bound_pdd": q["bound_pdd"]}
