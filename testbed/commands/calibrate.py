"""`testbed calibrate --engine vllm --model DIR --out profile.yaml`: a profile measured from a
real engine (issue 20 item 5, docs/vllm.md "Calibration").

Starts one vLLM server on loopback (`testbed.calibrun`; or measures yours at --url), measures T_prefill(l) (also with a
cached prefix), T_step(B, C), S_kv and the decode memory, fits them in the profile engine's
form and writes the profile at --out with the raw measurements beside it (`testbed.calibfit`);
`model.profile: profile.yaml` then runs the profile engine as this engine, at any scale.
With --pair CPUS a decode server starts beside it and the KV pull between the two is measured
too (`testbed.calibpair`: the profile gets `kv_transfer: pull` and `kv_pull_latency`).
Bounded: the measuring stops at --budget (points not reached are skipped, and said so).
With --from-run RUN --base PROFILE it measures nothing: the prefill and decode step of PROFILE
are refitted from what a run of the real engine stamped in its deployment (testbed.calibinsitu).
"""

import pathlib
import re
import sys
import time

from testbed import calibfit, calibinsitu, calibrun, vllmenv
from testbed.errors import ConfigError
from testbed.records import RunDir

LENGTHS = (256, 512, 1024, 2048, 4096)
BATCHES = (1, 2, 4, 8)
CONTEXTS = (128, 1024, 2048)
_CPUS = re.compile(r"nobind|\d+(-\d+)?(,\d+(-\d+)?)*")


def register(subparsers):
    p = subparsers.add_parser(
        "calibrate", help="measure a real engine (vLLM) into a profile file (model.profile)",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--engine", choices=["vllm"], default="vllm", help="the engine measured")
    p.add_argument("--model", metavar="DIR",
                   help="model directory (`testbed models --write DIR` writes a small one); "
                        "required unless --from-run")
    p.add_argument("--out", required=True, metavar="PROFILE.yaml",
                   help="the profile to write (its raw measurements go to PROFILE.csv)")
    p.add_argument("--accelerator", default="cpu",
                   help="the accelerator's name in the profile (clusters.*.accelerator)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                   help="prefill prompt lengths, tokens (comma separated)")
    p.add_argument("--repeats", type=int, default=3,
                   help="prefills per length and decode runs per point (medians are fitted)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="decode batch sizes (at most --max-num-seqs)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                   help="decode prompt lengths per request, tokens")
    p.add_argument("--steps", type=int, default=16, help="tokens per decode stream")
    p.add_argument("--max-num-seqs", type=int, default=8, help="vLLM's batch (BS_max)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-space-gib", type=int, default=1,
                   help="VLLM_CPU_KVCACHE_SPACE, whole GiB (the decode memory measured)")
    p.add_argument("--cpus", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--budget", type=float, default=180.0,
                   help="seconds of measuring after start-up (default 180)")
    p.add_argument("--start-timeout", type=float, default=240.0,
                   help="bound on the server's start-up, seconds")
    p.add_argument("--url", metavar="URL",
                   help="measure the vLLM server already running at URL (e.g. yours on a GPU "
                        "host; --model is the directory it loaded) instead of starting one; "
                        "its --max-num-seqs must match yours")
    p.add_argument("--pair", metavar="CPUS",
                   help="also start a decode server (same connector) bound to CPUS (a CPU "
                        "list such as 1, or nobind) and measure the KV pull between the two: "
                        "the profile gets kv_transfer: pull and the measured kv_pull_latency "
                        "(docs/vllm.md)")
    p.add_argument("--from-run", action="append", metavar="RUN",
                   help="refit --base's prefill and decode step from this run of the real "
                        "engine (model.engine: vllm) instead of measuring: what the engine "
                        "took inside its deployment (repeat for several runs; docs/vllm.md)")
    p.add_argument("--base", metavar="PROFILE.yaml",
                   help="with --from-run: the calibrated profile whose KV size, memory and "
                        "KV pull are kept")
    p.set_defaults(func=run)
    return p


def _refuse(msg):
    print(f"testbed calibrate: {msg}", file=sys.stderr)
    return 2


def _plan(args):
    """The measurement plan, or the one-line reason it is refused."""
    try:
        lengths, batches, contexts = (tuple(int(x) for x in a.split(","))
                                      for a in (args.lengths, args.batches, args.contexts))
    except ValueError:
        return None, "--lengths, --batches, --contexts: expected comma-separated integers"
    if len(set(lengths)) < 3:
        return None, "--lengths: at least 3 distinct prompt lengths (a degree-2 fit)"
    # a prefill completion generates 1 token, a decode stream `steps`: both must fit
    longest = max(tuple(l + 1 for l in lengths) + tuple(c + args.steps for c in contexts))
    if longest > args.max_model_len:
        return None, (f"--lengths/--contexts: {longest} tokens (prompt and generated) exceed "
                      f"--max-model-len {args.max_model_len}")
    if args.pair is not None and (args.url or not _CPUS.fullmatch(args.pair)):
        return None, (f"--pair {args.pair}: expected a CPU list (1, 0-1) or nobind, and no "
                      f"--url (the pair is started here)")
    if max(batches) > args.max_num_seqs or min(batches + lengths + contexts) < 1:
        return None, "--batches: each from 1 to --max-num-seqs; lengths and contexts >= 1"
    return {"prefill_lengths": lengths, "repeats": max(1, args.repeats), "cached": True,
            "step_repeats": max(1, args.repeats),
            "batches": batches, "contexts": contexts, "steps": max(4, args.steps),
            "dtype": args.dtype, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "kv_cache_space_gib": args.kv_cache_space_gib,
            "cpus": args.cpus, "start_timeout_s": args.start_timeout, "pair": args.pair}, ""


def from_runs(args, out):
    """--from-run: refit --base from the runs' records; the exit code."""
    if not args.base or not pathlib.Path(args.base).is_file():
        return _refuse(f"--from-run needs --base PROFILE.yaml, an existing calibrated profile "
                       f"(got {args.base})")
    for r in args.from_run:
        if not RunDir(r).requests.is_file():
            return _refuse(f"--from-run {r}: no {RunDir(r).requests.name} (a run directory "
                           f"that `testbed run` finished and analysed)")
    try:
        profile, raw, errors = calibinsitu.refit(args.base, args.from_run, out,
                                                 args.accelerator)
    except (ConfigError, KeyError, ValueError) as e:
        return _refuse(f"{e}")
    print(f"calibrate: wrote {profile} and {raw} from {len(args.from_run)} run(s); median "
          f"|fit error| %: {errors}")
    return 0


def run(args):
    out = pathlib.Path(args.out)
    if out.suffix not in (".yaml", ".yml"):
        return _refuse(f"--out {out}: expected a .yaml file (model.profile reads it)")
    if args.from_run:
        return from_runs(args, out)
    if not args.model:
        return _refuse("--model DIR is required (or --from-run RUN --base PROFILE.yaml)")
    model = pathlib.Path(args.model).expanduser()
    if not (model / "config.json").is_file():
        return _refuse(f"--model {model}: no config.json (a Hugging Face model directory; "
                       f"`testbed models --write DIR` writes one)")
    python = vllmenv.find_python()
    if python is None and not args.url:
        return _refuse(vllmenv.INSTALL_HINT)
    if args.url and not args.url.startswith(("http://", "https://")):
        return _refuse(f"--url {args.url}: expected http://HOST:PORT")
    plan, why = _plan(args)
    if plan is None:
        return _refuse(why)
    log = out.with_suffix(".server.log")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"calibrate: measuring {args.url} ({model})" if args.url else
          f"calibrate: starting vLLM on {model} (server log {log})", flush=True)
    try:
        m, skipped = calibrun.run(python, model.resolve(), plan, log,
                                  lambda line: print(f"calibrate: {line}", flush=True),
                                  args.budget, url=args.url)
    except (calibrun.ServerFailed, calibrun.vllm_api.VllmRequestError) as e:
        return _refuse(f"{e}")
    m.info["wall_s"] = round(time.monotonic() - t0, 1)
    profile, raw, errors = calibfit.write(m, out, args.accelerator)
    if skipped:
        print(f"calibrate: --budget {args.budget:g}s reached; skipped {', '.join(skipped)}")
    print(f"calibrate: wrote {profile} and {raw} in {m.info['wall_s']:.0f} s; median |fit "
          f"error| %: {errors}")
    return 0
