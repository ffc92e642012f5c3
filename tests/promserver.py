"""A real Prometheus server for the live exporter's tests (Debian's `prometheus` package).

`prometheus` (a fixture) starts one on 127.0.0.1 with its own temporary directory and the
repository's dashboards/prometheus.yml, the scrape target moved to a free port, and stops it
(SIGTERM to its PID, SIGKILL if it lingers); `query` and `scalar` ask its HTTP API.
"""

import json
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout_s):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not ready after {timeout_s:.0f}s")
        time.sleep(0.1)


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server on 127.0.0.1 scraping 127.0.0.1:<metrics port>; (api url, port)."""
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus package is not installed (make test installs it)")
    metrics_port, web_port = free_port(), free_port()
    conf = (ROOT / "dashboards" / "prometheus.yml").read_text().replace(
        "127.0.0.1:9464", f"127.0.0.1:{metrics_port}")
    d = tmp_path / "prometheus"
    d.mkdir()
    (d / "prometheus.yml").write_text(conf)
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
         f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=open(d / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{web_port}/-/ready", 60)
        yield f"http://127.0.0.1:{web_port}/api/v1", metrics_port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(api, expr):
    url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as r:
        out = json.loads(r.read())
    assert out["status"] == "success", out
    return out["data"]["result"]


def scalar(api, expr):
    res = query(api, expr)
    assert len(res) == 1, f"{expr}: {res}"
    return float(res[0]["value"][1])
