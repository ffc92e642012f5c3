"""The measured capacity is compared with the prediction replicate by replicate."""

import pandas as pd
import pytest

from testbed import plot_load


def _frame(rows):
    base = {"series": "homogeneous", "policy": "homogeneous", "offered_rate": 1.0,
            "replicate": 0, "median_ttft_ms": 1.0, "p90_ttft_ms": 2.0, "mean_tpot_ms": 3.0,
            "request_throughput": 1.0, "mean_ttft_ms": 1.0, "model_median_ttft_ms": None,
            "model_p90_ttft_ms": None, "model_mean_ttft_ms": None}
    out = []
    for load, steady, lam in rows:
        out.append({**base, "load": load, "steady_throughput": steady, "lambda_max": lam,
                    "capacity_ratio": plot_load._ratio(steady, lam)})
    return pd.DataFrame(out)


def test_capacity_is_paired_per_replicate():
    # Each replicate measures exactly its own prediction while the predictions spread by
    # 40% between replicates: the paired ratio is 1 with no spread; the point below the
    # capacity load is not part of it.
    rows = [(1.3, 0.50, 0.50), (1.3, 0.70, 0.70), (1.3, 0.55, 0.55), (1.3, 0.60, 0.60),
            (1.3, 0.65, 0.65), (0.5, 0.3, 0.60)]
    cap = plot_load.capacity_table(plot_load.load_table(_frame(rows)))
    assert list(cap.series) == ["homogeneous"] and int(cap.n.iloc[0]) == 5
    assert cap.capacity_ratio.iloc[0] == pytest.approx(1.0)
    assert cap.steady_throughput.iloc[0] == pytest.approx(0.60)


def test_ratio_without_a_prediction_is_none():
    assert plot_load._ratio(0.5, None) is None and plot_load._ratio(None, 0.5) is None
