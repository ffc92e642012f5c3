"""A real Prometheus server on loopback (Debian's `prometheus` package), for the tests and the
benchmarks that scrape the live exporter.

`running(workdir, metrics_port)` starts one on 127.0.0.1 with its own directory under `workdir`
and the repository's dashboards/prometheus.yml, the scrape target moved to `metrics_port`; it
yields the HTTP API's URL and stops the server at the end (SIGTERM to its PID, SIGKILL if it
lingers). `query` asks the API.
"""

import contextlib
import json
import pathlib
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request

from testbed.ports import free_ports

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
READY_TIMEOUT_S = 60


def free_port():
    return free_ports(1)[0]


def wait_http(url, timeout_s):
    """Until `url` answers 200 (bounded: RuntimeError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")
        time.sleep(0.1)


@contextlib.contextmanager
def running(workdir, metrics_port):
    """A Prometheus server on 127.0.0.1 scraping 127.0.0.1:`metrics_port`; yields its API URL."""
    if PROMETHEUS is None:
        raise RuntimeError("Debian's prometheus package is not installed (make test installs it)")
    web_port = free_port()
    conf = (REPO / "dashboards" / "prometheus.yml").read_text().replace(
        "127.0.0.1:9464", f"127.0.0.1:{metrics_port}")
    d = pathlib.Path(workdir) / "prometheus"
    d.mkdir(parents=True)
    (d / "prometheus.yml").write_text(conf)
    with open(d / "prometheus.log", "w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={d / 'prometheus.yml'}",
             f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{web_port}"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{web_port}/-/ready", READY_TIMEOUT_S)
        yield f"http://127.0.0.1:{web_port}/api/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(api, expr):
    """The result list of an instant query (RuntimeError if Prometheus says it failed)."""
    url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as r:
        out = json.loads(r.read())
    if out["status"] != "success":
        raise RuntimeError(f"Prometheus query {expr!r} failed: {out}")
    return out["data"]["result"]
