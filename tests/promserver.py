"""A real Prometheus server for the live exporter's tests (Debian's `prometheus` package).

`prometheus` (a fixture) starts one with testbed.live.promserver (127.0.0.1, its own temporary
directory, the repository's dashboards/prometheus.yml with the scrape target moved to a free
port) and stops it; `query` and `scalar` ask its HTTP API.
"""

import pytest

from testbed.live.promserver import PROMETHEUS, free_port, query, running  # noqa: F401


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server on 127.0.0.1 scraping 127.0.0.1:<metrics port>; (api url, port)."""
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus package is not installed (make test installs it)")
    metrics_port = free_port()
    with running(tmp_path, metrics_port) as api:
        yield api, metrics_port


def scalar(api, expr):
    res = query(api, expr)
    assert len(res) == 1, f"{expr}: {res}"
    return float(res[0]["value"][1])
