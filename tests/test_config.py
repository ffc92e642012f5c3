"""Describe: validation errors, variants and sweeps, scale conversion (no root)."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from conftest import SMALL_EXPERIMENT
from testbed import config, deploy
from testbed.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
BASE = SMALL_EXPERIMENT


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_quickstart_expands_to_three_policies():
    runs = config.load_experiment(QUICKSTART)
    assert [r.label for r in runs] == ["homogeneous", "naive", "prfaas"]
    homo = runs[0]
    assert homo.clusters.local.instances == 6 and homo.clusters.prfaas.instances == 0
    assert runs[2].scheduler.threshold == 19_400        # K = 1000, as for bytes


def test_scale_conversion(tmp_path):
    exp = config.load_experiment(write(tmp_path, BASE))[0]
    d = deploy.compile(exp).links["kv"]
    assert d.rate_bps == pytest.approx(100e9 * 1e-3 * 10)     # rate * bytes * time
    assert d.delay_s == pytest.approx(5e-3 / 10)              # delay / time


def test_per_direction_override(tmp_path):
    text = BASE.replace("wan: {rate: 100Gbit, delay: 5ms}",
                        "wan: {rate: 100Gbit, delay: 5ms, request: {rate: 10Gbit}}")
    exp = config.load_experiment(write(tmp_path, text))[0]
    links = deploy.compile(exp).links
    assert links["request"].rate_bps == pytest.approx(10e9 * 1e-2)
    assert links["kv"].rate_bps == pytest.approx(100e9 * 1e-2)


@pytest.mark.parametrize("change,key,expected", [
    (("requests: 10", "requests: 10\nbogus: 1"), "bogus", "unknown key"),
    (("rate: 100Gbit", "rate: 100 apples"), "network.wan.rate", "expected a rate"),
    (("tokens: 1K", "tokens: lots"), "workload.input.tokens", "expected a token count"),
    (("prefill: 1, decode: 1", "prefill: 1, decode: 2"), "clusters.local", "must equal"),
    (("scale: {time: 10, bytes: 1e-3}", "scale: {time: 100, bytes: 1e-2}"), "scale",
     "above what this machine can shape"),
    (("requests: 10", "requests: ten"), "requests", "expected an integer"),
])
def test_bad_input_names_file_key_and_expectation(tmp_path, change, key, expected):
    p = write(tmp_path, BASE.replace(*change))
    with pytest.raises(ConfigError) as e:
        deploy.load(p)      # the emulated link is checked where it is compiled
    msg = str(e.value)
    assert str(p) in msg and key in msg and expected in msg
    assert e.value.exit_code == 2


def test_variants_and_sweep_cross(tmp_path):
    text = BASE + textwrap.dedent("""\
        variants:
          - {scheduler.policy: naive, clusters.local.prefill: 0, clusters.local.decode: 2}
          - {scheduler.policy: prfaas}
        sweep:
          network.wan.delay: [1ms, 10ms]
        """)
    runs = config.load_experiment(write(tmp_path, text))
    assert len(runs) == 4
    assert {r.network.wan.delay for r in runs} == {1e-3, 10e-3}
    assert len({r.label for r in runs}) == 4


def test_set_override(tmp_path):
    runs = config.load_experiment(write(tmp_path, BASE), ["scheduler.threshold=32K",
                                                          "workload.arrival.rate=2/s"])
    assert runs[0].scheduler.threshold == 32_000
    assert runs[0].workload.arrival.rate == 2.0


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file"):
        config.load_experiment("/nonexistent/x.yaml")


def test_unsafe_yaml_is_rejected(tmp_path):
    p = write(tmp_path, BASE + "x: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load_experiment(p)


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    p = write(tmp_path, BASE.replace("rate: 100Gbit", "rate: 100 apples"))
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "network.wan.rate" in lines[0] and str(p) in lines[0]


def test_link_changes_and_rate_trace_are_scaled(tmp_path):
    (tmp_path / "bw.csv").write_text("# comment\ntime,rate\n0s,100Gbit\n60s,20Gbit\n")
    text = BASE.replace("wan: {rate: 100Gbit, delay: 5ms}", textwrap.dedent("""\
        wan:
            rate: 100Gbit
            delay: 5ms
            rate_trace: {path: bw.csv, direction: kv}
            changes: [{at: 30s, up: false}, {at: 40s, up: true, delay: 20ms}]"""))
    exp = config.load_experiment(write(tmp_path, text))[0]
    items = [c.item() for c in deploy.compile(exp).link_changes]
    assert [round(t, 6) for t, _, _ in items] == [0.0, 3.0, 4.0, 6.0]     # real / scale.time
    assert items[1] == (3.0, None, {"up": False})
    assert items[2][2] == {"up": True, "delay": pytest.approx(2e-3)}
    assert items[3] == (6.0, "kv", {"rate": pytest.approx(20e9 * 1e-2)})


def test_queue_bytes_scale_and_too_small_a_queue_is_rejected(tmp_path):
    exp = config.load_experiment(write(tmp_path, BASE.replace(
        "delay: 5ms}", "delay: 5ms, queue: 64MiB}")))[0]
    assert deploy.compile(exp).links["kv"].queue == {"bytes": int(64 * 2**20 * 1e-3)}
    with pytest.raises(ConfigError, match="TSO burst"):
        deploy.load(write(tmp_path, BASE.replace("delay: 5ms}", "delay: 5ms, queue: 1MiB}")))


@pytest.mark.parametrize("text,expected", [
    ("time,rate\n0s,fast\n", "line 2"), ("0s,1Gbit\n5s,2Gbit,3\n", "line 2"),
    ("10s,1Gbit\n5s,1Gbit\n", "backwards"), ("# nothing\n", "no time,rate rows")])
def test_bad_rate_trace_is_caught_before_anything_runs(tmp_path, text, expected):
    (tmp_path / "bw.csv").write_text(text)
    p = write(tmp_path, BASE.replace("wan: {rate: 100Gbit, delay: 5ms}",
                                     "wan: {rate: 100Gbit, rate_trace: {path: bw.csv}}"))
    with pytest.raises(ConfigError, match=expected):
        config.load_experiment(p)


def test_swept_units_with_a_slash_make_a_safe_label(tmp_path):
    runs = config.load_experiment(write(tmp_path, BASE + "sweep: {workload.arrival.rate: [1/s, 2/s]}\n"))
    assert [r.label for r in runs] == ["prfaas,rate=1_per_s", "prfaas,rate=2_per_s"]


@pytest.mark.parametrize("name", ["/etc/x", "../../../../tmp/x", "..", "a\x07b", "", "x" * 101])
def test_unsafe_names_are_refused(tmp_path, name):
    p = write(tmp_path, BASE.replace("name: t", f"name: {name!r}".replace("'", '"')))
    with pytest.raises(ConfigError, match="name"):
        config.load_experiment(p)
