"""Benchmarks that cannot rot: every file in benchmarks/ has a smoke mode, and the suite runs it.

A benchmark is not part of the suite's pass/fail for its numbers (STYLE.md, habit 10), but it
must run: `benchmarks/X.py --smoke` takes tiny parameters, exercises the real code path end to
end in seconds and prints its normal output. The files are found by glob, so a new benchmark
without `--smoke` fails here at once. `--help` (no root) also imports each one, and benchmarks
import their library modules at the top, so a moved function fails in the unit tests, not
months later on a root machine. Root benchmarks are marked `root`; those needing Ray, py-spy or
torch skip with the reason when it is missing.
"""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from testbed import loadgen, vllmenv
from testbed.config import load_experiment
from testbed.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
SMOKE_TIMEOUT_S = 300

# What a benchmark needs beyond the unit tests' environment; one not listed needs nothing (a new
# benchmark that needs root, Ray, py-spy or torch is added here, or its smoke test fails).
NEEDS = {
    "emulation_speed.py": {"root"},
    "kv_transfer.py": {"root", "torch"},
    "link_fidelity.py": {"root"},
    "live_cost.py": {"root"},
    "loss_recovery.py": {"root"},
    "model_step.py": {"torch"},
    "pilot_pairs.py": {"root"},
    "prefix_prefill.py": {"torch"},
    "profile_run.py": {"root", "py-spy"},
    "ray_linktest.py": {"root", "ray"},
    "ray_vs_mininet.py": {"root", "ray"},
    "shaper_burst.py": {"root"},
    "tcp_timers.py": {"root"},
    "ttft_excess.py": {"root"},
    "vllm_bench_up.py": {"root", "vllm"},
    "vllm_calibration.py": {"root", "vllm"},
    "worker_rss.py": {"root"},
}


# Smokes whose whole path a root test already runs end to end: `make test` skips them (with
# this reason) to stay inside its time budget; `make bench-smoke` (TB_ALL_SMOKES=1) runs them.
COVERED = {
    "link_fidelity.py": "tests/test_link_root.py, tests/test_path_limits_root.py and "
                        "tests/test_crosscheck_root.py (the probe on built links, checked by "
                        "ping and iperf3)",
    "pilot_pairs.py": "test_smoke[emulation_speed] (`testbed run` of the case study, its one "
                      "path) and tests/test_autojudge.py (the steady excess and the outlook it "
                      "reads)",
    "shaper_burst.py": "tests/test_link_root.py (the probe on built links; this builds them "
                       "the same way, with another HTB burst)",
    "live_cost.py": "tests/test_live_root.py (a real Prometheus scrapes live runs), "
                    "test_smoke[profile_run] and tests/test_replicates.py (compare)",
    "ray_linktest.py": "tests/test_ray_root.py::test_linktest_through_the_agents_meets_linktest_"
                       "tolerances",
    "ray_vs_mininet.py": "tests/test_ray_root.py::test_tiny_run_on_ray_namespace_hosts and "
                         "tests/test_run_root.py::test_tiny_run_measured_facts",
    "vllm_bench_up.py": "tests/test_vllm_root.py (bench serve through the front door) and "
                        "tests/test_live_root.py (a live up through the forward); a vLLM "
                        "start-up of minutes",
    "vllm_calibration.py": "tests/test_vllm.py::test_calibrate_measures_the_running_server_into_"
                           "a_profile_it_runs and tests/test_vllm_root.py (minutes of vLLM "
                           "start-ups)",
}


def _pyspy():
    return shutil.which("py-spy") or (pathlib.Path(sys.executable).with_name("py-spy").exists()
                                      or None)


MISSING = {
    "ray": lambda: importlib.util.find_spec("ray") is None and
    "Ray is not installed (`make cluster`, the [cluster] extra)",
    "py-spy": lambda: _pyspy() is None and "py-spy is not installed (the [profile] extra)",
    "torch": lambda: importlib.util.find_spec("torch") is None and
    "torch is not installed (the [torch] extra)",
    "vllm": lambda: vllmenv.find_python() is None and "vLLM is not installed (`make vllm`)",
}


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")


def _params():
    for path in BENCHMARKS:
        needs = NEEDS.get(path.name, set())
        marks = [pytest.mark.slow] + ([pytest.mark.root] if "root" in needs else [])
        yield pytest.param(path, needs, marks=marks, id=path.stem)


def test_benchmarks_found():
    assert len(BENCHMARKS) >= 10, BENCHMARKS
    stale = (set(NEEDS) | set(COVERED)) - {p.name for p in BENCHMARKS}
    assert not stale, f"NEEDS names benchmarks that are gone: {stale}"


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_imports_and_accepts_smoke(path):
    """`--help` imports the benchmark (its library imports sit at the top) and lists --smoke."""
    r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True,
                       cwd=ROOT, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--smoke" in r.stdout, f"{path.name} has no --smoke mode"


def test_benchmarks_import_no_other_benchmark():
    """Benchmarks import library modules only, never each other (STYLE.md, habit 13)."""
    names = {p.stem for p in BENCHMARKS}
    for path in BENCHMARKS:
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                top = words[1].split(".")[0]
                assert top not in names and top != "benchmarks", (path.name, line)


@pytest.mark.parametrize("path,needs", list(_params()))
def test_smoke(path, needs):
    if path.name in COVERED and not os.environ.get("TB_ALL_SMOKES"):
        pytest.skip(f"its path is run by {COVERED[path.name]}; `make bench-smoke` runs it")
    for need in sorted(needs - {"root"}):
        reason = MISSING[need]()
        if reason:
            pytest.skip(reason)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(path), "--smoke"], capture_output=True, text=True,
                       cwd=ROOT, env=_env(), timeout=SMOKE_TIMEOUT_S)
    assert r.returncode == 0, f"{path.name} --smoke exited {r.returncode}:\n" \
        f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip(), f"{path.name} --smoke printed nothing"
    print(f"{path.name} --smoke: {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_benchmark_experiments_validate(path):
    """The experiment files benchmarks drive (smoke.yaml; frontdoor_aiperf.yaml, docs/frontdoor.md)
    validate: entirely, or, where an optional tool is missing (aiperf for an aiperf client, the
    vLLM venv for a vLLM engine, as in a fresh worktree), with its absence the only thing
    refused."""
    try:
        assert load_experiment(path)
    except ConfigError as e:
        missing = {"aiperf is not installed": loadgen.find_aiperf() is None,
                   vllmenv.INSTALL_HINT: vllmenv.find_python() is None}
        if not any(absent and text in str(e) for text, absent in missing.items()):
            raise
