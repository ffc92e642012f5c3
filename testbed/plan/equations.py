"""The paper's equations, array-valued: each accepts scalars or numpy arrays of thresholds.

Part of `testbed.plan` (the package docstring has the model and its symbols). Pure functions of
real-world quantities: bytes, seconds, requests per second.
"""

import numpy as np

def Phi_kv(s_kv_bytes, t_prefill_s):
    """KV throughput of one instance, bytes/s."""
    return np.asarray(s_kv_bytes, dtype=float) / np.asarray(t_prefill_s, dtype=float)


def B_out_min(n_instances, phi_kv_Bps):
    """Minimum egress of a prefill cluster (bytes/s): (N/P) * Phi_kv(L_avg), N/P = instances."""
    return n_instances * np.asarray(phi_kv_Bps, dtype=float)


def Theta_prfaas(n_prfaas, t_prefill_remote_s, s_kv_bytes, b_out_Bps):
    """PrfaaS stage throughput (requests/s): compute limit or egress limit, whichever is lower."""
    compute = np.asarray(n_prfaas, dtype=float) / np.asarray(t_prefill_remote_s, dtype=float)
    bandwidth = b_out_Bps / np.asarray(s_kv_bytes, dtype=float)
    return np.minimum(compute, bandwidth)


def Theta_pdp(n_p, t_prefill_local_s):
    """Local PD prefill stage throughput (requests/s)."""
    return np.asarray(n_p, dtype=float) / np.asarray(t_prefill_local_s, dtype=float)


def Theta_pdd(n_d, bs_max, t_decode_s, l_out):
    """Local PD decode stage throughput (requests/s)."""
    return np.asarray(n_d, dtype=float) * bs_max / (t_decode_s * l_out)


def share_bound(theta, share):
    """Theta / share: the arrival rate a stage sustains when it gets `share` of the requests.

    A stage with no share is no bound (inf), whatever its Theta (0, or undefined)."""
    theta = np.asarray(theta, dtype=float)
    share = np.asarray(share, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(share > 0, theta / np.where(share > 0, share, 1.0), np.inf)


def Lambda_max(theta_prfaas, theta_pdp, theta_pdd, p):
    """System throughput at saturation: min(Theta_prfaas/p, Theta_pdp/(1-p), Theta_pdd)."""
    p = np.asarray(p, dtype=float)
    return np.minimum(np.minimum(share_bound(theta_prfaas, p), share_bound(theta_pdp, 1.0 - p)),
                      np.asarray(theta_pdd, dtype=float))
