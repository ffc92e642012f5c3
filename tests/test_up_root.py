"""`testbed up` (root): a deployment held up, driven from the root namespace through the forward.

`testbed up tests/data/tiny.yaml` runs as a subprocess; the test waits for the forwarded address
it prints (127.0.0.1:PORT), sends streaming /v1/completions through it from this (the root)
namespace, checks each server-sent-event stream and its usage chunk, then sends SIGINT and checks
that the run's namespaces, interfaces, processes and state file are gone, that the forwarded port
is closed, and that `testbed analyse` finds exactly the requests that were sent.
"""

import contextlib
import json
import queue
import re
import signal
import socket
import subprocess
import threading
import urllib.request

import pytest

from test_run_root import ROOT, STATE_DIR, TINY, leftovers, tb_cmd

pytestmark = [pytest.mark.root, pytest.mark.slow]

UP_TIMEOUT_S = 180           # building the network and starting the workers on a loaded machine
PROMPTS = [600, 1200, 5000]  # tokens: local and (over the 4Ki threshold) remote prefill
MAX_TOKENS = 8


def _lines(stream):
    q = queue.Queue()

    def pump():
        for line in stream:
            q.put(line)
        q.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for_line(q, pattern, timeout_s):
    seen = []
    while True:
        line = q.get(timeout=timeout_s)
        if line is None:
            raise AssertionError(f"testbed up ended before printing {pattern!r}: {seen}")
        seen.append(line)
        if m := re.search(pattern, line):
            return m


def _stream_completion(url, model, n_prompt, rid):
    body = {"model": model, "prompt": " ".join(f"w{i}" for i in range(n_prompt)),
            "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": rid})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if line:
                assert line.startswith("data: "), line
                events.append(line[len("data: "):])
    return events


@contextlib.contextmanager
def held_up(out, *extra, probe=False):
    """`testbed up` of the tiny experiment into `out` (`extra`: more arguments; `probe`: keep
    the WAN probe at start), its output piped: (process, its stdout lines as a queue); killed
    at the end if still running."""
    no_probe = [] if probe else ["--no-probe"]
    proc = subprocess.Popen(tb_cmd("up", str(TINY), "--out", str(out), *no_probe, *extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        yield proc, _lines(proc.stdout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def end_up(proc, sig=signal.SIGINT):
    """Ctrl-C (or `sig`) to a held `testbed up`; it exits 0 after its teardown."""
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    assert rc == 0, proc.stderr.read()[-3000:]


def test_up_serves_through_the_loopback_forward_and_tears_down(tmp_path):
    out = tmp_path / "run"
    with held_up(out) as (proc, q):
        url = _wait_for_line(q, r"forwarded:\s+(http://127\.0\.0\.1:\d+)/v1", UP_TIMEOUT_S)[1]
        model = _wait_for_line(q, r"model:\s+(\S+)", 5)[1]
        _wait_for_line(q, r"^up: ", 5)
        meta_up = json.loads((out / "up.json").read_text())
        assert meta_up["url"] == url and not meta_up["frontdoor_url"].startswith("http://127.")
        for i, n in enumerate(PROMPTS):
            events = _stream_completion(url, model, n, f"t{i}")
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            texts = [c["choices"][0]["text"] for c in chunks if c["choices"]
                     and c["choices"][0]["finish_reason"] is None]
            assert len(texts) == MAX_TOKENS
            usage = chunks[-1]
            assert usage["choices"] == [] and usage["usage"] == {
                "prompt_tokens": n, "completion_tokens": MAX_TOKENS,
                "total_tokens": n + MAX_TOKENS}
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        end_up(proc)
        stdout_tail = "".join(iter(q.get, None))
    assert stdout_tail.strip().splitlines()[-1] == str(out)
    # Nothing of the run is left: namespaces (processes), interfaces, state file, the forward.
    assert leftovers(out) == []
    meta = json.loads((out / "metadata.json").read_text())
    assert not (STATE_DIR / f"{meta['run_id']}.json").exists()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tb{meta['run_id']}" not in netns
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    assert meta["forward"]["connections"] == len(PROMPTS)
    # Arrival 0 (link schedule, faults) is when the deployment was up, after the workers.
    assert meta["client_start_at"] == meta_up["started_at"]
    events = (out / "events.csv").read_text()
    assert events.index("workers_ready") < events.index(",up,") < events.index("hold_ended")
    assert meta["teardown_errors"] == []
    # The records of what arrived are analysed again from the directory alone.
    r = subprocess.run(tb_cmd("analyse", str(out)), capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == summary["completed"] == len(PROMPTS)
    assert summary["frontdoor"]["outcomes"] == {"ok": len(PROMPTS)}
    http = [json.loads(x) for x in (out / "frontdoor.jsonl").read_text().splitlines()]
    assert sorted(h["client_request_id"] for h in http if h["ev"] == "http") == ["t0", "t1", "t2"]
    assert sorted(h["prompt_tokens"] for h in http if h["ev"] == "http") == PROMPTS


def test_up_that_served_nothing_tears_down_cleanly(tmp_path):
    out = tmp_path / "run"
    with held_up(out) as (proc, q):
        _wait_for_line(q, r"^up: ", UP_TIMEOUT_S)
        end_up(proc, signal.SIGTERM)
    assert leftovers(out) == []
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["forward"]["connections"] == 0 and meta["teardown_errors"] == []
