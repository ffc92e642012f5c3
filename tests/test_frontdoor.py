"""The front door's HTTP side without root: request parsing, errors, streaming, disconnects.

The scheduler is replaced by a stub whose `Submit` streams tokens on a timer and records
whether its call was cancelled; everything else (aiohttp server, SSE framing, records) is real.
"""

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time

import pandas as pd
import pytest
from aiohttp.test_utils import TestClient, TestServer

from testbed import config, loadgen, loadrun, loadstats
from testbed.errors import ConfigError
from testbed.runtime import InstanceRuntime, WorkerRuntime
from testbed.scale import Scale
from testbed.proto import testbed_pb2 as pb
from workers import frontdoor
from workers.frontdoor import FrontDoor, HttpError, parse

MODEL = "kimi-linear-1t"
ROOT = pathlib.Path(__file__).resolve().parent.parent


class FakeCall:
    def __init__(self, stub, req, gap_s, fail):
        self.stub, self.req, self.gap_s, self.fail = stub, req, gap_s, fail
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        self.stub.inflight += 1
        try:
            for i in range(self.req.output_len):
                await asyncio.sleep(self.gap_s)
                if self.fail and i == self.fail:
                    yield pb.TokenChunk(done=True, status="failed", error="decode ld0 died")
                    return
                yield pb.TokenChunk(times=[time.time()])
            yield pb.TokenChunk(done=True, status="ok")
        finally:
            self.stub.inflight -= 1

    def cancel(self):
        self.cancelled = True


class FakeStub:
    def __init__(self, gap_s=0.002, fail=0):
        self.gap_s, self.fail = gap_s, fail
        self.calls, self.inflight = [], 0

    def Submit(self, req, timeout=None):
        call = FakeCall(self, req, self.gap_s, self.fail)
        self.calls.append(call)
        return call


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp_path, stub, fn, max_context=1000):
    async def main():
        door = FrontDoor(stub, MODEL, max_context, tmp_path / "requests.jsonl",
                         tmp_path / "frontdoor.jsonl")
        server = TestServer(door.app(), handler_cancellation=True)
        async with TestClient(server) as client:
            out = await fn(client)
        await door.stop()
        door.close()
        return out
    return asyncio.run(main())


def _events(text):
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_parse_counts_tokens_by_whitespace_and_extension():
    p = parse(json.dumps({"model": MODEL, "prompt": "a  b\nc\td", "max_tokens": 3}), False,
              MODEL, 100)
    assert (p.prompt_tokens, p.max_tokens, p.stream) == (4, 3, False)
    p = parse(json.dumps({"model": MODEL, "prompt": [1, 2, 3]}), False, MODEL, 100)
    assert (p.prompt_tokens, p.max_tokens) == (3, frontdoor.DEFAULT_MAX_TOKENS)
    p = parse(json.dumps({"model": MODEL, "prompt": "x", "prompt_tokens": 50, "stream": True,
                          "stream_options": {"include_usage": True}}), False, MODEL, 100)
    assert (p.prompt_tokens, p.stream, p.include_usage) == (50, True, True)
    p = parse(json.dumps({"model": MODEL, "max_completion_tokens": 5, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there world"}]}]}),
        True, MODEL, 100)
    assert (p.prompt_tokens, p.max_tokens) == (5, 5)


def test_prefix_blocks_are_chained_and_shared():
    a = " ".join(f"w{i}" for i in range(3 * 512 + 10))
    b = " ".join(f"w{i}" for i in range(2 * 512)) + " other" * 600
    pa = parse(json.dumps({"model": MODEL, "prompt": a}), False, MODEL, 10_000).prefix_blocks
    pb_ = parse(json.dumps({"model": MODEL, "prompt": b}), False, MODEL, 10_000).prefix_blocks
    assert len(pa) == 3 and len(pb_) == 3
    assert pa[:2] == pb_[:2] and pa[2] != pb_[2]
    assert all(0 < x < 2**63 for x in pa)


@pytest.mark.parametrize("body, status, code_or_param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "hi"}).encode(), 400, "model"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model_not_found"),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": {"x": 1}}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "5"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 2}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": MODEL, "prompt": "w " * 990, "max_tokens": 20}).encode(), 400,
     "context_length_exceeded"),
])
def test_bad_requests_get_json_errors_and_are_counted(tmp_path, body, status, code_or_param):
    stub = FakeStub()

    async def fn(client):
        r = await client.post("/v1/completions", data=body,
                              headers={"Content-Type": "application/json"})
        return r.status, await r.json()
    got, err = _run(tmp_path, stub, fn)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    if code_or_param is not None:
        assert code_or_param in (err["error"]["code"], err["error"]["param"])
    assert not stub.calls                       # nothing reached the scheduler
    rows = _rows(tmp_path / "frontdoor.jsonl")
    assert rows[0]["outcome"] == "rejected" and rows[0]["http_status"] == status
    assert rows[-1]["outcomes"] == {"rejected": 1}


def test_chat_messages_malformed(tmp_path):
    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"content": "no role"}]})
        return r.status, await r.json()
    status, err = _run(tmp_path, FakeStub(), fn)
    assert status == 400 and err["error"]["param"] == "messages"


def test_completions_stream_sse_usage_and_records(tmp_path):
    stub = FakeStub()

    async def fn(client):
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "one two three", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return r.status, await r.text()
    status, text = _run(tmp_path, stub, fn)
    assert status == 200
    ev = _events(text)
    assert ev[-1] == "[DONE]"
    chunks = [json.loads(e) for e in ev[:-1]]
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(tokens) == 5 and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert stub.calls[0].req.input_len == 3 and stub.calls[0].req.output_len == 5
    recs = _rows(tmp_path / "requests.jsonl")
    done = [r for r in recs if r["ev"] == "done"]
    assert len(done) == 1 and done[0]["status"] == "ok" and done[0]["n_tokens"] == 5
    assert recs[-1]["ev"] == "finished"
    http = _rows(tmp_path / "frontdoor.jsonl")[0]
    assert http["outcome"] == "ok" and http["n_tokens"] == 5
    assert http["arrival"] <= done[0]["send_time"] <= done[0]["first_token"] <= http["first_token"]


def test_chat_stream_and_non_stream(tmp_path):
    async def fn(client):
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True})
        s = await r.text()
        r2 = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        m = await client.get("/v1/models")
        return s, await r2.json(), await m.json()
    s, full, models = _run(tmp_path, FakeStub(), fn)
    chunks = [json.loads(e) for e in _events(s)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) == 3
    assert full["usage"]["completion_tokens"] == 4
    assert full["choices"][0]["message"]["content"] == frontdoor.TOKEN_TEXT * 4
    assert models["data"][0]["id"] == MODEL


def test_failure_before_first_token_is_502_after_is_an_error_event(tmp_path):
    async def fn(client):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "max_tokens": 4, "stream": True})
        return r.status, await r.text()
    status, text = _run(tmp_path, FakeStub(fail=2), fn)
    ev = _events(text)
    assert status == 200 and "upstream_failed" in ev[-2] and ev[-1] == "[DONE]"
    done = [r for r in _rows(tmp_path / "requests.jsonl") if r["ev"] == "done"][0]
    assert done["status"] == "failed" and done["error"] == "decode ld0 died"


def test_client_disconnect_cancels_the_submit(tmp_path):
    stub = FakeStub(gap_s=0.05)

    async def fn(client):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "max_tokens": 100, "stream": True})
        await r.content.readline()           # the first token has arrived
        r.close()                            # the client goes away mid-stream
        for _ in range(100):
            if stub.calls[0].cancelled and stub.inflight == 0:
                break
            await asyncio.sleep(0.02)
        return stub.calls[0].cancelled, stub.inflight
    cancelled, inflight = _run(tmp_path, stub, fn)
    assert cancelled and inflight == 0
    done = [r for r in _rows(tmp_path / "requests.jsonl") if r["ev"] == "done"][0]
    assert done["status"] == "failed" and done["error"] == "client disconnected"
    assert 0 < done["n_tokens"] < 100
    http = _rows(tmp_path / "frontdoor.jsonl")
    assert http[0]["outcome"] == "disconnected" and http[-1]["outcomes"] == {"disconnected": 1}


def test_body_too_large_is_413(tmp_path, monkeypatch):
    monkeypatch.setattr(frontdoor, "MAX_BODY_BYTES", 1000)

    async def fn(client):
        r = await client.post("/v1/completions", data=b"x" * 5000)
        return r.status, await r.json()
    status, err = _run(tmp_path, FakeStub(), fn)
    assert status == 413 and err["error"]["code"] == "body_too_large"


def test_http_error_body_shape():
    e = HttpError(400, "bad", param="prompt")
    assert e.body() == {"error": {"message": "bad", "type": "invalid_request_error",
                                  "param": "prompt", "code": None}}


# ---- workload.client keys and the trace handed to external tools ----

TINY = pathlib.Path(__file__).resolve().parent / "data" / "tiny.yaml"


@pytest.mark.parametrize("sets, key, words", [
    (["workload.client=command"], "workload", "needs workload.command"),
    (["workload.command=echo {url}"], "workload", "set client: command"),
    (["workload.client=command", "workload.command=no-such-tool-xyz {url}"],
     "workload.command", "not found"),
    (["workload.client=command", "workload.command=\"echo 'unbalanced\""], "workload.command",
     "cannot split"),
    (["workload.client=webui"], "workload.client", "expected one of builtin, command, aiperf"),
    (["workload.frontdoor.port=70000"], "workload.frontdoor.port", "<= 65535"),
])
def test_client_keys_are_checked(sets, key, words):
    with pytest.raises(ConfigError) as e:
        config.load_experiment(TINY, sets)
    assert key in str(e.value) and words in str(e.value)


def test_aiperf_missing_is_one_line_exit_2(tmp_path):
    env = dict(os.environ, TESTBED_AIPERF=str(tmp_path / "none"), PATH="/usr/bin:/bin")
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "workload", str(TINY), "--set",
                        "workload.client=aiperf"], capture_output=True, text=True, env=env,
                       cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "aiperf is not installed" in r.stderr and "workload.client" in r.stderr


def test_command_argv_substitution_and_trace(tmp_path):
    exp = config.load_experiment(TINY, ["workload.client=command",
                                        "workload.command=curl -s {url}/v1/models --x={model}"])[0]
    rt = WorkerRuntime(instances={"client": InstanceRuntime(name="client", role="client",
                                                            dc="local", ip="10.2.0.3")},
                       frontdoor=loadgen.runtime(exp), request_timeout_s=30)
    from testbed.workload import generate
    wl = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration)
    trace = loadrun.write_trace(tmp_path, wl, Scale.of(exp))
    argv = loadrun.client_argv(exp, rt, tmp_path, trace)
    assert argv == ["curl", "-s", "http://10.2.0.3:8000/v1/models", "--x=kimi-linear-1t"]
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == len(wl)
    assert [r["input_length"] for r in rows] == wl.input_len.tolist()
    assert rows[-1]["timestamp"] == round(wl.arrival_s.iloc[-1] / exp.scale.time * 1e3)


def _two_served(tmp_path, scale):
    """Two streamed completions (3 and 7 words) through the front door; (workload served, the
    request list built from its records)."""
    async def fn(client):
        for n in (3, 7):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a " * n,
                                                           "max_tokens": 4, "stream": True})
            await r.text()
    _run(tmp_path, FakeStub(), fn)
    from testbed.metrics import build_requests
    from testbed.records import read_records
    wl = loadstats.served_workload(tmp_path, scale)
    sent, done = read_records(tmp_path / "requests.jsonl")
    return wl, build_requests(wl, sent, done, scale)


def test_served_workload_and_compare(tmp_path):
    """The front door's records become the analysed request list; a tool's records pair with
    them in start order."""
    wl, ours = _two_served(tmp_path, Scale(10.0))
    assert wl.id.tolist() == [0, 1] and wl.input_len.tolist() == [3, 7]
    assert wl.output_len.tolist() == [4, 4] and wl.arrival_s.iloc[0] == 0.0
    tool = pd.DataFrame({"start": ours.send_time - 0.001,
                         "ttft_s": (ours.first_token - ours.send_time) + 0.002, "ok": True})
    c = loadstats.compare(tool, ours, Scale(10.0))
    assert c["completed"] == c["completed_testbed"] == c["paired"] == 2
    assert c["ttft_diff_ms_median"] == pytest.approx(20.0)
    assert c["ttft_diff_emulated_ms_median"] == pytest.approx(2.0)


def test_aiperf_exports_are_read_and_compared(tmp_path, monkeypatch):
    """aiperf 0.13's exports of a real aiperf run against the front door (3 requests, loopback,
    the scheduler replaced by the stub above), read beside the front door's records."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(ROOT / "tests" / "data" / "aiperf_run", run)
    monkeypatch.setenv(loadgen.AIPERF_ENV, "/bin/true")
    exp = config.load_experiment(TINY, ["workload.client=aiperf", "scale.time=1",
                                        "slo.ttft=30ms"])[0]
    from testbed.metrics import build_requests
    from testbed.records import read_records
    sent, done = read_records(run / "requests.jsonl")
    df = build_requests(loadstats.served_workload(run, Scale(1.0)), sent, done, Scale(1.0))
    tool = loadstats.read_aiperf(run)
    assert len(tool) == 3 and tool.ok.all()
    s = loadstats.summarize(run, exp, df, Scale(1.0))
    assert s["frontdoor"]["outcomes"] == {"ok": 3}
    a = s["aiperf"]
    assert a["request_count"] == 3 and a["errors"] == []
    assert a["reported_ttft_ms"]["p50"] == pytest.approx(19.613935)
    # paired exactly: aiperf's X-Request-Id is in the front door's records
    ids = {h["client_request_id"]: h["id"] for h in loadstats.read_http(run)}
    assert sorted(ids) == sorted(tool.rid) and sorted(ids.values()) == [0, 1, 2]
    c = a["compare"]
    assert c["paired"] == c["completed"] == c["completed_testbed"] == 3
    # aiperf's clock starts before the request is written, so its TTFT is never below ours
    assert c["ttft_diff_ms_median"] > 0
    # ... and the difference splits into four causal legs, every request paired by its id
    legs = c["gap_legs_emulated_ms"]
    assert legs["paired"] == 3
    assert all(legs[k]["median"] >= 0 for k in ("client_send", "frontdoor_in", "frontdoor_out",
                                               "client_receive"))
    good = int((tool.ttft_s * 1e3 <= 30).sum())
    span = (tool.start + tool.e2el_s).max() - tool.start.min()
    assert a["request_goodput"] == pytest.approx(good / span)


def test_run_refuses_client_none_before_building_anything(tmp_path):
    """`client: none` is `testbed up`'s; `testbed run` says so (exit 2) and makes nothing."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(TINY), "--out", str(out),
                        "--set", "workload.client=none"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "testbed up" in r.stderr and "workload.client" in r.stderr
    assert not out.exists()


def test_event_loop_lateness_is_sampled_into_the_summary(tmp_path):
    """A handler that blocks the loop for 30 ms shows as lateness of at least ~20 ms (a lower
    bound only: the loop cannot wake the sampler while it is blocked)."""
    async def main():
        door = FrontDoor(FakeStub(), MODEL, 1000, tmp_path / "requests.jsonl",
                         tmp_path / "frontdoor.jsonl")
        lag = asyncio.create_task(door.watch_lag())
        await asyncio.sleep(0.05)
        time.sleep(0.03)                 # the loop is busy, as with many streams at once
        await asyncio.sleep(0.05)
        lag.cancel()
        door.close()
    asyncio.run(main())
    summary = [r for r in _rows(tmp_path / "frontdoor.jsonl") if r["ev"] == "summary"][0]
    lag = summary["loop_lag_ms"]
    assert lag["samples"] >= 3 and lag["max"] >= 15 and lag["p50"] <= lag["p99"] <= lag["max"]


def test_vllm_bench_argv_sends_the_workloads_count_rate_and_mean_lengths(tmp_path, monkeypatch):
    from testbed import vllmenv
    monkeypatch.setattr(vllmenv, "find_python", lambda: "/venv/bin/python")
    exp = config.load_experiment(TINY, ["workload.client=vllm-bench"])[0]
    rt = WorkerRuntime(instances={"client": InstanceRuntime(name="client", role="client",
                                                            dc="local", ip="10.2.0.3")},
                       frontdoor=loadgen.runtime(exp), request_timeout_s=30)
    from testbed.workload import generate
    wl = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration)
    trace = loadrun.write_trace(tmp_path, wl, Scale.of(exp))
    argv = loadrun.client_argv(exp, rt, tmp_path, trace)
    assert argv[0] == "/venv/bin/python" and argv[1].endswith("workers/vllm_bench.py")
    opt = dict(zip(argv, argv[1:]))
    assert opt["--base-url"] == "http://10.2.0.3:8000" and opt["--num-prompts"] == "12"
    assert int(opt["--random-input-len"]) == round(wl.input_len.mean())
    span = (wl.arrival_s.iloc[-1] - wl.arrival_s.iloc[0]) / exp.scale.time
    assert float(opt["--request-rate"]) == pytest.approx(11 / span, rel=1e-3)


def test_vllm_bench_results_are_read_onto_our_clock_and_compared(tmp_path):
    """bench serve's --save-detailed result (perf_counter start times, emulated seconds) and
    the clock offset workers/vllm_bench.py wrote become the per-request comparison."""
    from testbed.records import RunDir
    scale = Scale(10.0)
    _, ours = _two_served(tmp_path, scale)
    rd = RunDir(tmp_path)
    rd.vllm_bench.mkdir()
    offset = 1000.0
    ttft = (ours.first_token - ours.send_time + 0.002).tolist()
    e2el = (ours.end_time - ours.send_time + 0.002).tolist() if "end_time" in ours else [
        t + 0.01 for t in ttft]
    rd.vllm_bench_result.write_text(json.dumps({
        "completed": 2, "failed": 0, "request_throughput": 5.0,
        "median_ttft_ms": 3.0, "p90_ttft_ms": 4.0, "start_times": (ours.send_time - 0.001
                                                                    - offset).tolist(),
        "ttfts": ttft, "latencies": e2el, "output_lens": [4, 4], "errors": ["", ""]}))
    rd.vllm_bench_clock.write_text(json.dumps({"unix_minus_perf_counter_s": offset}))
    vb = loadstats.vllm_bench_summary(tmp_path, ours, scale)
    assert vb["completed"] == 2 and vb["reported"]["median_ttft_ms"] == pytest.approx(30.0)
    assert vb["request_throughput_per_s"] == pytest.approx(0.5)
    c = vb["compare"]
    assert c["paired"] == 2 and c["ttft_diff_ms_median"] == pytest.approx(20.0)
    assert c["send_before_submit_ms_median"] == pytest.approx(1.0, abs=1e-3)
    assert c["tpot_diff_ms_median"] is not None
