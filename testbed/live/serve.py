"""`--metrics PORT`: the exporter process started beside the orchestrator, and stopped by it.

`Exporter.start(top, port)` runs `python -m testbed.live.exporter` on the run's top directory in
the root namespace, bound to 127.0.0.1:PORT, waits (bounded) until the port accepts connections
or the process exits (a port in use: `ConfigError`, exit code 2, before anything is built), and
sets `TESTBED_LIVE_STATUS_S` so the workers started after it write their status files
(workers/status.py). `stop()` ends it by its PID (SIGTERM, then SIGKILL) after its last poll
and one more scrape (at most 5 s), and writes `live.json` beside the run: URL, PID and the
exporter's CPU seconds (its share of the run's CPU is what docs/live.md reports).
`watching(top, port)`: the same as a context (nothing when `port` is None), what
`testbed.run.execute` holds around its variants.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

from testbed import lifecycle
from testbed.errors import ConfigError
from testbed.records import RunDir
from workers.status import STATUS_ENV

START_TIMEOUT_S = 20.0      # importing prometheus_client and pandas on a loaded 2-core machine
STATUS_PERIOD_S = 1.0       # the workers' status files (wall clock): the exporter's poll


def _listening(host, port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _cpu_s(pid):
    """User + system CPU seconds of a live process (/proc/PID/stat), or None."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Exporter:
    def __init__(self, top, port, host="127.0.0.1"):
        self.top, self.port, self.host = pathlib.Path(top), port, host
        self.proc = None
        self.started_at = None

    @classmethod
    def start(cls, top, port, host="127.0.0.1"):
        return cls(top, port, host)._start()

    def _start(self):
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--metrics must be a port 1..65535, got {self.port}",
                              key="--metrics")
        if _listening(self.host, self.port):
            raise ConfigError(f"--metrics: {self.host}:{self.port} is in use", key="--metrics")
        self.log = open(RunDir(self.top).live_log, "w")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testbed.live.exporter", "--dir", str(self.top),
             "--port", str(self.port), "--host", self.host],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
            preexec_fn=lifecycle.die_with_parent())     # SIGKILL with the orchestrator
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(self.host, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                why = RunDir(self.top).live_log.read_text().strip().splitlines()[-1:] or ["timeout"]
                raise ConfigError(f"--metrics: the exporter did not start: {why[0]}",
                                  key="--metrics")
            time.sleep(0.05)
        os.environ[STATUS_ENV] = f"{STATUS_PERIOD_S:g}"
        return self

    @property
    def url(self):
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self):
        """End the exporter (its last poll first) and record its cost in live.json."""
        os.environ.pop(STATUS_ENV, None)
        if self.proc is None:
            return
        cpu = _cpu_s(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        RunDir(self.top).live.write_text(json.dumps(
            {"url": self.url, "pid": self.proc.pid, "started_at": self.started_at,
             "stopped_at": time.time(), "cpu_s": cpu, "code": self.proc.returncode}, indent=1))
        self.proc = None


@contextlib.contextmanager
def watching(top, port, host="127.0.0.1"):
    """The exporter serving `top` on host:port while the block runs; nothing when port is None."""
    if port is None:
        yield None
        return
    exporter = Exporter.start(top, port, host)
    try:
        yield exporter
    finally:
        exporter.stop()
