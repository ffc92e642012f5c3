"""`testbed selfcheck` end to end: prefill and decode in two processes, state over real TCP."""

import json
import subprocess

import pytest

from testbed import cli


def _run(capsys, *extra):
    code = cli.main(["selfcheck", "--json", "--prompt-len", "200", *extra])
    return code, json.loads(capsys.readouterr().out)


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.root
def test_selfcheck_across_two_namespaces(capsys):
    code, r = _run(capsys)
    assert code == 0 and r["passed"]
    assert r["path"]["mode"] == "netns+veth"
    assert r["max_abs_diff"] <= 1e-4
    assert r["tokens_agree"] == r["decoded_tokens"] == 32
    # The kernel saw at least the state bytes cross the veth.
    assert r["path"]["kernel_rx_bytes"] >= r["state_bytes"] == r["analytical_state_bytes"]
    left = _netns()
    assert not any(ns in left for ns in r["path"]["netns"])


@pytest.mark.slow
def test_selfcheck_on_loopback(capsys):
    code, r = _run(capsys, "--loopback", "--new-tokens", "8")
    assert code == 0 and r["path"]["mode"] == "loopback"
    assert r["max_abs_diff"] <= 1e-4


@pytest.mark.root
def test_selfcheck_prefix_continued_prefill_across_two_namespaces(capsys):
    """Prefill continuing from a cached prefix (pool block bytes) + shipped state + decode ==
    one forward pass."""
    code, r = _run(capsys, "--prefix-len", "128", "--block", "64", "--new-tokens", "8")
    assert code == 0 and r["passed"] and r["prefix_len"] == 128
    assert r["path"]["mode"] == "netns+veth" and r["max_abs_diff"] <= 1e-4
    assert r["tokens_agree"] == r["decoded_tokens"] == 8
