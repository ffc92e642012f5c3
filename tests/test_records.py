"""The run directory's typed records and the compile-once contract (no root).

- A request record goes through one type: the client's and the front door's `Tracker` write a
  `RequestRecord`, `read_records` gives it back typed, and analysis never probes a raw record
  dict with `.get(`.
- `deploy.compile` runs once per run: validation never compiles, the runner compiles every
  run once and passes the Deployment on, and analysing a copied run directory compiles
  nothing (it reads deployment.json).
"""

import ast
import dataclasses
import json
import pathlib
import shutil

import pytest

from testbed import analysis, config, deploy, run
from testbed.proto import testbed_pb2 as pb
from testbed.records import RecordLog, RequestRecord, SentRecord, read_records
from workers.client import Tracker

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "quickstart_run"
QUICK = ROOT / "experiments" / "quickstart.yaml"


# ---------------------------------------------------------------- one typed record

def _chunk(times, done=False):
    c = pb.TokenChunk(times=times, done=done)
    if done:
        c.status = "ok"
        c.route.kind, c.route.prefill, c.route.decode = "remote", "rp0", "ld0"
        c.prefill.start, c.prefill.end, c.prefill.kv_bytes = 10.1, 10.4, 4096
        c.kv_recv_end = 10.5
    return c


def test_what_the_client_writes_reads_back_as_one_typed_record(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RecordLog(path)
    log.write(SentRecord(id=7, send_time=10.0, scheduled=9.99, lateness_s=0.01))
    track = Tracker(pb.Request(id=7, output_len=3), 10.0)
    track.add(_chunk([10.6]), 10.61)
    track.add(_chunk([10.7, 10.8], done=True), 10.82)
    log.write(track.record())
    log.close()
    sent, done = read_records(path)
    assert isinstance(sent[7], SentRecord) and sent[7].lateness_s == pytest.approx(0.01)
    r = done[7]
    assert isinstance(r, RequestRecord) and r.status == "ok" and r.n_tokens == 3
    assert (r.route, r.prefill_instance, r.decode_instance) == ("remote", "rp0", "ld0")
    assert r.first_token == 10.61 and r.last_token == 10.82
    assert r.token_times == pytest.approx([10.6, 10.7, 10.8], abs=1e-6)
    assert r.client_times == [10.61, 10.82, 10.82]
    assert r.kv_bytes_sent == 4096 and r.kv_recv_end == 10.5 and r.end_time > 0
    assert not hasattr(r, "get") and not hasattr(sent[7], "get")    # no probing of a dict


def test_a_line_of_another_writer_keeps_its_extra_keys(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"ev": "done", "id": 1, "status": "ok", "gpu": "h200"}) + "\n")
    _, done = read_records(path)
    assert done[1].extra == {"gpu": "h200"} and done[1].columns()["gpu"] == "h200"


def _raw_record_gets(tree):
    """`.get(` calls on a request record: a value taken out of what read_records returned
    (or out of a function's `sent`/`done` parameters), by subscript, by `.get` or by iterating.
    Looking a record up by id (`done.get(rid)`) is a lookup in a dict of records, not a probe."""
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        maps = {a.arg for a in fn.args.args if a.arg in ("sent", "done")}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and getattr(
                    n.value.func, "id", getattr(n.value.func, "attr", "")) == "read_records":
                for t in n.targets:
                    maps |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}

        def taken(e):       # a record out of one of the maps
            if isinstance(e, ast.Subscript):
                e = e.value
            elif isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) \
                    and e.func.attr in ("get", "values", "items"):
                e = e.func.value
            else:
                return False
            return isinstance(e, ast.Name) and e.id in maps
        records = set()
        for n in ast.walk(fn):
            if isinstance(n, (ast.For, ast.comprehension)) and (
                    taken(n.iter) or isinstance(n.iter, ast.Name) and n.iter.id in maps):
                records |= {e.id for e in ast.walk(n.target) if isinstance(e, ast.Name)}
            if isinstance(n, ast.Assign):
                values = n.value.elts if isinstance(n.value, ast.Tuple) else [n.value]
                targets = n.targets[0].elts if isinstance(n.targets[0], ast.Tuple) else n.targets
                for t, v in zip(targets, values):
                    if isinstance(t, ast.Name) and taken(v):
                        records.add(t.id)
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr == "get":
                base = n.func.value
                if taken(base) or isinstance(base, ast.Name) and base.id in records:
                    bad.append((fn.name, n.lineno))
    return bad


def test_no_get_on_raw_request_records_outside_the_records_module():
    files = [p for d in ("testbed", "workers") for p in sorted((ROOT / d).rglob("*.py"))
             if p.name != "records.py" and "proto" not in p.parts]
    found = {str(p.relative_to(ROOT)): b for p in files
             if (b := _raw_record_gets(ast.parse(p.read_text())))}
    assert not found, found


def test_the_get_check_sees_a_raw_record_read():
    tree = ast.parse("def f(p):\n    sent, done = read_records(p)\n    r = done.get(1)\n"
                     "    return [d.get('route') for d in done.values()], sent[1].get('x'), "
                     "r.get('id')\n")
    assert [line for _, line in _raw_record_gets(tree)] == [4, 4, 4]


# ---------------------------------------------------------------- compiled once

def _no_compile(*a, **k):
    raise AssertionError("compiled")


def test_validation_never_compiles(monkeypatch):
    monkeypatch.setattr(deploy, "compile", _no_compile)
    monkeypatch.setattr(deploy, "emulated_link", _no_compile)
    runs = config.load_experiment(QUICK)
    assert len(runs) == 3


def test_the_runner_compiles_each_run_once_and_passes_it_on(monkeypatch, tmp_path):
    compiled, ran = [], []
    real = deploy.compile

    def counting(exp, path=None):
        compiled.append(exp.label)
        return real(exp, path)

    def execute(self):
        ran.append((self.exp.label, self.deployment))
        return {"label": self.exp.label}
    monkeypatch.setattr(deploy, "compile", counting)
    monkeypatch.setattr(run.Run, "execute", execute)
    monkeypatch.setattr(run, "preflight", lambda backend, dep: None)
    monkeypatch.setattr(run.plot, "run_figures", lambda top: [])
    monkeypatch.setattr(run.analysis, "write_sweep", lambda top, s: None)
    monkeypatch.setattr(run.os, "geteuid", lambda: 0)      # the runs themselves are stubbed
    top, summaries = run.execute(QUICK, out=tmp_path / "out")
    labels = [s["label"] for s in summaries]
    assert sorted(compiled) == sorted(labels) and len(set(compiled)) == 3
    assert all(isinstance(dep, deploy.Deployment) and dep.label == label for label, dep in ran)


def test_analysing_a_copied_run_directory_compiles_nothing(monkeypatch, tmp_path):
    d = tmp_path / "prfaas"
    shutil.copytree(FIXTURE / "prfaas", d)
    before = json.loads((d / "summary.json").read_text())
    (d / "summary.json").unlink()
    for name in ("compile", "emulated_link", "load"):
        monkeypatch.setattr(deploy, name, _no_compile)
    monkeypatch.setattr(config, "load_experiment", _no_compile)
    monkeypatch.setattr(config, "validate", _no_compile)
    s = analysis.analyse(d)
    assert s["completed"] == before["completed"] > 0
    assert s["p90_ttft_ms"] == pytest.approx(before["p90_ttft_ms"])


def test_the_links_analysis_reads_are_the_ones_the_run_compiled():
    d = FIXTURE / "prfaas"
    info = analysis.rundir.load_run(d)
    built = deploy.compile(info.experiment).links
    assert {k: dataclasses.asdict(v) for k, v in info.links.items()} == {
        k: dataclasses.asdict(v) for k, v in built.items()}


def test_the_client_says_when_every_request_has_its_first_token(tmp_path):
    """`--first-tokens-file` (a pilot step's, testbed/run.py): written once, when the last of
    the workload's requests had its first token or ended, not before."""
    from workers.client import FirstTokens
    path = tmp_path / "ready" / "first_tokens"
    path.parent.mkdir()
    first = FirstTokens(path, [3, 4, 9])
    for rid in (4, 4, 9, 7):        # twice, or not one of the workload's: no matter
        first.seen(rid)
        assert not path.exists()
    first.seen(3)
    assert float(path.read_text()) > 0 and not list(path.parent.glob(".*"))
