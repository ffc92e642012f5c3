"""Malformed experiments (tests/corpus/malformed/, one YAML per case, its first line says what
is wrong) stop with exit code 2 and one line, before anything is started or written (no root).

`run` is exercised as users call it, `python -m testbed.cli run FILE`: it validates before its
privilege check, so the same line comes with or without sudo. Starting a fresh interpreter per
file costs seconds of imports on two cores, so one subprocess imports the CLI once and forks a
child per file that runs `python -m testbed.cli run FILE` from there (`runpy`, the same entry
point, its own exit code and stderr); a few files also run in a plain fresh interpreter. `plan`
and `workload` go through the same `testbed.cli.main` in-process.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from testbed import cli
from testbed.config import _no_cuda_reason
from testbed.net.spec import netem_in_kernel

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus" / "malformed"


def corpus():
    files = sorted(CORPUS.glob("*.yaml"))
    if netem_in_kernel():       # valid on a kernel that has netem
        files = [f for f in files if f.name != "backend_netem_without_netem.yaml"]
    if not _no_cuda_reason():   # valid on a machine with a GPU and a CUDA build
        files = [f for f in files if f.name != "torch_cuda_without_gpu.yaml"]
    return files


def generated(tmp_path):
    """Cases too big to keep in the repository: a 2 MB file, a million-element list."""
    base = (CORPUS / "apples.yaml").read_text().replace("100 apples", "100Gbit")
    big = tmp_path / "huge_file.yaml"
    big.write_text("# a 2 MB file\n" + "#" * (2 << 20) + "\n" + base)
    million = tmp_path / "million_element_list.yaml"
    million.write_text(base + "sweep: {seed: [" + ",".join(["1"] * 1_000_000) + "]}\n")
    return [big, million]


def _snapshot():
    """What a run of this checkout could leave behind: its results/ tree. (Orchestrator state in
    /run/prfaas-testbed and namespaces need root, and other checkouts on the machine may change
    them meanwhile; the refusal comes before the privilege check either way.)"""
    results = ROOT / "results"
    return sorted(str(p.relative_to(results)) for p in results.rglob("*")) \
        if results.exists() else []


def _check(path, code, stderr):
    lines = stderr.strip().splitlines()
    why = (path.read_bytes().split(b"\n", 1)[0]).decode("utf-8", "replace")
    assert code == 2, f"{path.name} ({why}): exit {code}: {stderr[-2000:]}"
    assert 1 <= len(lines) <= 3, f"{path.name}: {len(lines)} lines: {stderr[-2000:]}"
    assert "Traceback" not in stderr, f"{path.name}: {stderr[-2000:]}"


FORK_RUNNER = textwrap.dedent("""\
    import json, os, runpy, sys, tempfile, time
    import testbed.cli, testbed.config, testbed.run, testbed.commands.run  # imported once
    for path in sys.argv[1:]:
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = ["testbed", "run", path]
            code = 1
            try:
                runpy.run_module("testbed.cli", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        print(json.dumps({"path": path, "code": os.waitstatus_to_exitcode(status),
                          "s": time.monotonic() - t0, "stdout": out.read().decode(errors="replace"),
                          "stderr": err.read().decode(errors="replace")}), flush=True)
""")


def _run_all(files):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", FORK_RUNNER, *map(str, files)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_corpus_covers_every_category():
    names = {f.stem for f in CORPUS.glob("*.yaml")}
    assert len(names) >= 100
    for f in CORPUS.glob("*.yaml"):
        first = f.read_bytes().lstrip(b"\xef\xbb\xbf").split(b"\n", 1)[0]
        assert first.startswith(b"#") or b"\xff\xfe" in first, f"{f.name}: no comment line"


def test_run_refuses_every_malformed_file_before_starting_anything(tmp_path):
    before = _snapshot()
    files = corpus() + generated(tmp_path)
    results = _run_all(files)
    assert len(results) == len(files)
    for res in results:
        _check(pathlib.Path(res["path"]), res["code"], res["stderr"])
        assert res["stdout"] == "", f"{res['path']}: printed {res['stdout'][:200]!r}"
    assert _snapshot() == before
    assert not (pathlib.Path("/etc") / "x").exists()


@pytest.mark.parametrize("name", ["name_absolute", "billion_laughs", "binary_nul",
                                  "change_rate_zero"])
def test_run_in_a_fresh_interpreter(name):
    before = _snapshot()
    path = CORPUS / f"{name}.yaml"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    _check(path, r.returncode, r.stderr)
    assert r.stdout == "" and _snapshot() == before


@pytest.mark.parametrize("verb", ["plan", "workload"])
def test_plan_and_workload_refuse_every_malformed_file(verb, tmp_path, capsys):
    before = _snapshot()
    for path in corpus() + generated(tmp_path):
        code = cli.main([verb, str(path)])
        out, err = capsys.readouterr()
        _check(path, code, err)
        assert out == "", f"{verb} {path.name}: printed {out[:200]!r}"
    assert _snapshot() == before


@pytest.mark.parametrize("override,expected", [
    ("requests=012", "leading zero"), ("requests=ten", "expected an integer"),
    ("=3", "dotted key"), ("a..b=1", "dotted key"), ("name.x=1", "not a mapping"),
    ("variants=3", "variants"), ("sweep=[1]", "sweep"), ("name=/etc/x", "path separator"),
    ("seed", "key=value"), ("model.torch.ratio=3:1", "sexagesimal"),
    ("workload.arrival.rate={a: 1, a: 2}", "duplicate key")])
def test_bad_set_overrides_exit_2_with_one_line(override, expected, capsys):
    code = cli.main(["workload", str(ROOT / "experiments" / "quickstart.yaml"), "--set", override])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
