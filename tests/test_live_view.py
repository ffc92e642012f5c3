"""The live terminal view in a real terminal (tmux): its per-variant line is redrawn as a run
directory grows, and under CI the plain tqdm bar shows instead.

A driver script in a tmux pane appends `done` records to a run directory (the tiny experiment's
runtime.json, records in the client's format) while a view tracks it, as testbed/run.py's drive
loop does; `tmux capture-pane` reads the screen while it goes. No root, no network.
"""

import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from test_run_root import ROOT

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

DRIVER = textwrap.dedent("""
    import json, pathlib, sys, time
    from testbed import deploy
    from testbed.live import view
    d = pathlib.Path(sys.argv[1])
    dep = deploy.load(sys.argv[2])[0][1]
    dep.runtime.dump(d / "runtime.json")
    n = 30
    p = view.tracker(view.choose(False), d, d / "requests.jsonl", n, "prfaas")  # as run.py does
    line = lambda obj: json.dumps(obj, separators=(",", ":")) + "\\n"   # the client's Recorder
    with open(d / "requests.jsonl", "a") as f:
        for i in range(n):
            t = time.time()
            f.write(line({"ev": "sent", "id": i, "send_time": t}))
            f.write(line({"ev": "done", "id": i, "send_time": t, "first_token": t + 0.01 * (i + 1),
                                "last_token": t + 0.5, "n_tokens": 2, "status": "ok",
                                "route": "remote", "decode_instance": "ld0"}))
            f.flush()
            for _ in range(3):
                p.poll()
                time.sleep(0.1)
    p.close()
    print("DRIVER-END", flush=True)
    time.sleep(30)
""")


def _pane(session, history=0):
    """The pane's screen (and `history` lines scrolled off above it)."""
    return subprocess.run(["tmux", "capture-pane", "-p", "-S", str(-history), "-t", session],
                          capture_output=True, text=True, check=True).stdout


def _screens(session, cmd, end, timeout_s, history=0):
    """Run `cmd` in a detached 200-column tmux session; the screens captured until one shows
    `end` (bounded), then the session is killed."""
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "20", cmd],
                   check=True)
    screens = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screens.append(_pane(session, history))
            if end in screens[-1]:
                break
            time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert end in screens[-1], screens[-1]
    return screens


def _watch(tmp_path, env=""):
    """Run the driver in tmux; the screens captured until it ends."""
    d = tmp_path / "run"
    d.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    session = f"tbview{tmp_path.name[-8:]}".replace(".", "")
    cmd = (f"cd {ROOT} && {env} PYTHONPATH={ROOT} {sys.executable} {script} {d} "
           f"{ROOT / 'tests' / 'data' / 'tiny.yaml'}")
    return _screens(session, cmd, "DRIVER-END", 90)


def test_view_redraws_the_variant_line_in_a_terminal(tmp_path):
    screens = _watch(tmp_path, env="CI=")
    done = []
    for s in screens:
        m = re.search(r"prfaas done (\d+)/30 failed 0 in flight \d+ \| TTFT p50 ([\d,]+) p90", s)
        if m:
            done.append(int(m.group(1)))
            assert s.count("prfaas done") == 1, s      # redrawn in place, not appended
    assert len(set(done)) >= 5 and done == sorted(done), done
    final = screens[-1]
    assert "prfaas done 30/30 failed 0 in flight 0" in final, final
    # TTFT p50 of 10, 20, ..., 300 ms (scale.time 20): 155 ms emulated = 3,100 ms real-world
    assert "TTFT p50 3,100 p90 5,420 ms" in final, final


def test_view_under_ci_is_the_plain_progress_bar(tmp_path):
    screens = _watch(tmp_path, env="CI=true")
    final = screens[-1]
    assert "prfaas done" not in final
    assert re.search(r"prfaas: 100%\|.*\| 30/30", final), final


# Two variants of the tiny experiment, slow enough (scale.time 2) that the view redraws each
# variant's line several times while its requests go.
REAL_RUN = """
variants:
  - {scheduler.policy: naive, clusters.local.prefill: 0, clusters.local.decode: 2}
  - {scheduler.policy: prfaas}
"""


@pytest.mark.root
@pytest.mark.slow
def test_view_of_a_real_run_under_tmux(tmp_path):
    """`testbed run` itself (two variants over the emulated network) in a tmux pane: each
    variant's line is drawn and updated while it runs and stays, finished, above the next."""
    from test_run_root import TINY, leftovers

    exp = tmp_path / "tiny2.yaml"
    exp.write_text(TINY.read_text() + REAL_RUN)
    out = tmp_path / "run"
    session = f"tbrun{tmp_path.name[-8:]}".replace(".", "")
    cmd = (f"cd {ROOT} && CI= PYTHONPATH={ROOT} {sys.executable} -m testbed.cli run {exp} "
           f"--out {out} --no-probe --set requests=20 --set scale.time=2; echo RUN-END rc=$?; "
           "sleep 60")
    screens = _screens(session, cmd, "RUN-END", 300, history=200)
    assert "RUN-END rc=0" in screens[-1], screens[-1]
    line = r"(naive|prfaas) done (\d+)/20 failed 0 in flight (\d+) \| TTFT p50 [\d,]+ p90"
    seen = {}
    for s in screens:
        for m in re.finditer(line, s):
            seen.setdefault(m.group(1), []).append(int(m.group(2)))
    for variant in ("naive", "prfaas"):
        done = seen.get(variant, [])
        assert len(set(done)) >= 3 and done == sorted(done), (variant, done)   # it moved
    final = screens[-1]
    assert re.search(r"naive done 20/20 failed 0 in flight 0.*\n(.*\n)*.*prfaas done 20/20 "
                     r"failed 0 in flight 0", final), final
    assert leftovers(out / "naive") == [] and leftovers(out / "prfaas") == []
    print("\n".join(ln for ln in final.splitlines() if " done " in ln))
