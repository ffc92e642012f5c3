"""What every backend writes into a run directory before it runs, and the metadata it starts from.

    config (Experiment) -> deploy (Deployment) -> runinputs (this) -> a backend runs -> analyse

The emulation's runner (testbed/run.py) and the simulator (testbed/sim/run.py) both call these,
so the run directory's inputs (config.yaml, deployment.json, runtime.json, workload.parquet)
and metadata.json's common keys are written in one place.
"""

import contextlib
import pathlib
import platform
import subprocess
import sys
import time

from importlib import metadata

import yaml

from testbed import __version__, config, eventloop
from testbed.records import RunDir
from testbed.workload import generate

REPO = pathlib.Path(__file__).resolve().parent.parent


def git_revision():
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else None
    except (OSError, subprocess.SubprocessError):
        return None


def versions():
    out = {"testbed": __version__, "python": platform.python_version()}
    for pkg in ("torch", "grpcio", "uvloop", "pyroute2", "pandas", "numpy", "seaborn"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def write_inputs(exp, dep, run_dir):
    """config.yaml, deployment.json, runtime.json and workload.parquet; returns the workload."""
    d = RunDir(run_dir)
    d.logs.mkdir(parents=True, exist_ok=True)
    d.config.write_text(yaml.safe_dump(config.resolved(exp), sort_keys=False))
    dep.dump(d.deployment)
    dep.runtime.dump(d.runtime)
    workload = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration)
    workload.to_parquet(d.workload, index=False)
    return workload


def base_metadata(exp, dep, workload):
    """metadata.json's keys every run has (the backend adds what it measured)."""
    meta = {"name": exp.name, "label": exp.label, "git_revision": git_revision(),
            "kernel": platform.release(), "host": platform.node(),
            "versions": versions(), "argv": sys.argv, "start_time": time.time(),
            "scale": dep.scale.to_dict(), "requests": len(workload),
            "backend": exp.backend.kind}
    if exp.backend.kind != "sim":       # the event loop its processes run (TESTBED_LOOP)
        meta["event_loop"] = eventloop.kind()
    return meta
