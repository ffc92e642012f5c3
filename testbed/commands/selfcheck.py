"""`testbed selfcheck`: the torch model's state really crosses a network and decodes correctly.

Prefill a prompt in one process, ship every layer's state (KDA recurrent state + conv tails,
MLA latent cache) over a real TCP connection, decode `--new-tokens` greedy tokens in another
process, and compare every logit with a single-process `forward_full` of the same tokens. The
check passes when the largest absolute difference is within `--tol` (1e-4, fp32).

As root the two processes run in two fresh network namespaces joined by a veth pair
(`testbed.net.pair.veth_pair`: names `tb<id>-pre` / `tb<id>-dec`, recorded in a
`testbed.lifecycle.Registry` and always removed);
the kernel's own byte counter of the receiving veth is reported next to the state size. Without
root they run on loopback, and the output says so.
"""

import json
import os
import pathlib
import secrets
import subprocess
import sys
import tempfile
import time

from testbed.errors import ConfigError, TestbedError, WorkerError
from testbed.lifecycle import Registry
from testbed.net import ns, pair as nspair

REPO = pathlib.Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0      # the decode peer imports torch and builds its model
PORT_FILE = "port"          # the decode peer writes its listening port here when ready
RUN_TIMEOUT_S = 300.0       # prefill + transfer + decode of a few hundred tokens


class SelfcheckFailed(TestbedError):
    """The decoded logits differ from the reference by more than the tolerance."""


def register(sub):
    p = sub.add_parser("selfcheck", help="prefill -> ship state over TCP -> decode == one pass",
                       description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16 needs cuda and a looser --tol")
    p.add_argument("--prompt-len", type=int, default=300, help="prompt tokens (default 300)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy decode steps (default 32)")
    p.add_argument("--tol", type=float, default=1e-4, help="max |logit difference| allowed")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--chunk-bytes", type=int, default=1 << 16, help="state_wire chunk size")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="prefill continues from a cached prefix of this many tokens (block bytes)")
    p.add_argument("--block", type=int, default=64, help="prefix-cache block, tokens (default 64)")
    p.add_argument("--loopback", action="store_true", help="skip namespaces even as root")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _check_args(a):
    import torch    # optional (the [torch] extra): selfcheck is the torch engine's check

    if a.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cuda requested but torch sees no CUDA device", key="--device")
    if a.dtype == "bfloat16" and a.device != "cuda":
        raise ConfigError("bfloat16 runs on cuda only", key="--dtype")
    if a.prompt_len < 1 or a.new_tokens < 1:
        raise ConfigError("must be >= 1", key="--prompt-len/--new-tokens")
    if a.prefix_len < 0 or a.prefix_len % a.block or a.prefix_len >= a.prompt_len:
        raise ConfigError(f"must be a multiple of --block ({a.block}) below --prompt-len",
                          key="--prefix-len")


# ---- the two peers ----

def _spawn(reg, netns, argv, log):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = ns.ns_popen(netns, [sys.executable, "-m", "workers.model.selfcheck_peer", *argv],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    reg.add_process(proc.pid, f"selfcheck {argv[0]} peer")
    return proc


def _wait_file(path, proc, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise WorkerError(f"selfcheck: {what} exited with code {proc.returncode} before ready")
        if time.monotonic() > deadline:
            raise WorkerError(f"selfcheck: {what} not ready after {timeout_s:.0f} s")
        time.sleep(0.05)
    return path.read_text()


def _wait_exit(proc, deadline, what, logfile):
    try:
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise WorkerError(f"selfcheck: {what} still running after {RUN_TIMEOUT_S:.0f} s") from None
    if code != 0:
        tail = pathlib.Path(logfile).read_text()[-2000:]
        raise WorkerError(f"selfcheck: {what} exited with code {code}:\n{tail}")


def run_peers(a, d, use_netns):
    """Start decode then prefill peer, wait for both; returns a dict describing the path."""
    reg = Registry(f"{secrets.token_hex(4)}", kind="selfcheck",
                   state_dir=None if use_netns else d / "state")
    try:
        if not use_netns:
            return _run_peers_over(reg, d, None)
        with nspair.veth_pair(reg, names=("pre", "dec")) as link:
            return _run_peers_over(reg, d, link)
    finally:
        errors = reg.close()
        if errors:
            print("selfcheck: teardown: " + "; ".join(errors), file=sys.stderr)


def _run_peers_over(reg, d, link):
    """The two peers over `link` (a `VethPair`), or on loopback when it is None."""
    path = {"mode": "loopback", "kernel_rx_bytes": None}
    ns_pre = ns_dec = None
    host = "127.0.0.1"
    if link is not None:
        ns_pre, ns_dec, host = link.a, link.b, link.ip_b
        path.update(mode="netns+veth", netns=[ns_pre, ns_dec], addresses=[link.ip_a, link.ip_b])
        rx0 = nspair.rx_bytes(ns_dec, link.if_b)
    with open(d / "decode.log", "w") as dlog, open(d / "prefill.log", "w") as plog:
        dec = _spawn(reg, ns_dec, ["decode", "--dir", str(d), "--listen", host], dlog)
        port = int(_wait_file(d / PORT_FILE, dec, READY_TIMEOUT_S, "decode peer"))
        pre = _spawn(reg, ns_pre, ["prefill", "--dir", str(d), "--connect", f"{host}:{port}"],
                     plog)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        _wait_exit(pre, deadline, "prefill peer", d / "prefill.log")
        _wait_exit(dec, deadline, "decode peer", d / "decode.log")
    if link is not None:
        path["kernel_rx_bytes"] = nspair.rx_bytes(ns_dec, link.if_b) - rx0
    return path


# ---- the comparison ----

def compare(a, d):
    import numpy as np   # with torch: selfcheck alone needs them
    import torch    # optional (the [torch] extra)

    from workers.model.config import HybridConfig   # torch
    from workers.model.hybrid import HybridModel, analytical_state_bytes   # torch

    req = json.loads((d / "request.json").read_text())
    cfg = HybridConfig.from_dict(req["config"])
    pre = np.load(d / "prefill.npz")
    dec = np.load(d / "decode.npz")
    model = HybridModel(cfg, device=a.device)
    full = model.forward_full(req["prompt"] + dec["tokens"].tolist()).cpu()
    P = len(req["prompt"])
    ref = full[P - 1:P - 1 + 1 + a.new_tokens]
    got = torch.cat([torch.from_numpy(pre["logits"])[None], torch.from_numpy(dec["logits"])])
    diff = (got - ref).abs()
    greedy = ref[:-1].argmax(-1)
    agree = int((greedy == torch.as_tensor(dec["tokens"])).sum())
    return {"max_abs_diff": float(diff.max()), "max_abs_diff_prefill": float(diff[0].max()),
            "max_abs_diff_decode": float(diff[1:].max()), "max_abs_logit": float(ref.abs().max()),
            "tokens_agree": agree, "analytical_state_bytes": analytical_state_bytes(cfg, P)}


def run(a):
    _check_args(a)
    import torch    # optional (the [torch] extra)

    from workers.model.config import HybridConfig   # torch

    use_netns = os.geteuid() == 0 and not a.loopback
    note = None if use_netns else ("not root: both peers run on loopback, not across two "
                                   "network namespaces" if os.geteuid() else "--loopback given")
    cfg = HybridConfig(seed=a.seed, dtype=a.dtype)
    g = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(0, cfg.vocab, (a.prompt_len,), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="tb-selfcheck-") as tmp:
        d = pathlib.Path(tmp)
        (d / "request.json").write_text(json.dumps({
            "config": cfg.to_dict(), "device": a.device, "prompt": prompt,
            "new_tokens": a.new_tokens, "chunk_bytes": a.chunk_bytes,
            "prefix_len": a.prefix_len, "block": a.block}))
        path = run_peers(a, d, use_netns)
        res = compare(a, d)
        pre = json.loads((d / "prefill.json").read_text())
        dec = json.loads((d / "decode.json").read_text())
    res.update(prefix_len=a.prefix_len, path=path, note=note, device=a.device, dtype=a.dtype, prompt_tokens=a.prompt_len,
               decoded_tokens=a.new_tokens, tol=a.tol, passed=res["max_abs_diff"] <= a.tol,
               state_bytes=dec["state_bytes"], wire_payload_bytes=dec["payload_bytes"],
               frames=dec["frames"], prefill_s=pre["prefill_s"],
               transfer_overlapping_compute_s=pre["transfer_overlapping_compute_s"],
               decode_step_ms=1e3 * dec["decode_s"] / dec["decode_steps"])
    print(json.dumps(res, indent=1) if a.json else report(res))
    if not res["passed"]:
        raise SelfcheckFailed(f"max |logit difference| {res['max_abs_diff']:.3g} > tol {a.tol:g}")
    return 0


def report(r):
    p = r["path"]
    where = (f"netns {p['netns'][0]} ({p['addresses'][0]}) -> veth -> netns {p['netns'][1]} "
             f"({p['addresses'][1]})" if p["mode"] != "loopback" else "loopback (127.0.0.1)")
    lines = [f"selfcheck: prefill -> TCP -> decode over {where}; {r['device']} {r['dtype']}"]
    if r["note"]:
        lines.append(f"  note: {r['note']}")
    lines += [
        f"  prompt {r['prompt_tokens']} tokens ({r['prefix_len']} from a cached prefix), "
        f"prefill {r['prefill_s'] * 1e3:.1f} ms; "
        f"decoded {r['decoded_tokens']} tokens greedy, {r['decode_step_ms']:.2f} ms/step",
        f"  state shipped: {r['state_bytes']} bytes (formula {r['analytical_state_bytes']}), "
        f"{r['wire_payload_bytes']} payload bytes in {r['frames']} frames"
        + (f"; kernel counted {p['kernel_rx_bytes']} bytes received on the veth"
           if p["kernel_rx_bytes"] is not None else ""),
        f"  transfer overlapping compute: {r['transfer_overlapping_compute_s'] * 1e3:.1f} ms",
        f"  greedy tokens equal to forward_full's argmax: {r['tokens_agree']}/{r['decoded_tokens']}",
        f"  max |logit difference| vs forward_full = {r['max_abs_diff']:.3g} "
        f"(prefill {r['max_abs_diff_prefill']:.3g}, decode {r['max_abs_diff_decode']:.3g}; "
        f"logits up to {r['max_abs_logit']:.2f}); tolerance {r['tol']:g}: "
        + ("PASS" if r["passed"] else "FAIL")]
    return "\n".join(lines)
