"""Does the calibrated profile engine reproduce the real vLLM engine? (issue 20, item 5)

1. `testbed calibrate --engine vllm --pair` measures a vLLM server of the testbed's model, a
   decode server beside it, into a profile (T_prefill(l), T_step(B, C), S_kv(l), decode
   memory, and the KV pull between the two: `kv_transfer: pull`, `kv_pull_latency`;
   `--stream`: one server alone, the KV streamed).
2. `testbed run` of benchmarks/vllm_calibration.yaml with the vLLM engine (one PrfaaS prefill
   server, one local decode server, the KV through NixlConnector across the shaped WAN), for
   each seed.
3. Unless `--loopback`: the experiment with the vLLM engine at the calibration seeds
   (`--calib-seeds`, 100 by default: not the measured ones), and `testbed calibrate --from-run`
   refits the profile's prefill and decode step from what the engine took in those runs (inside
   its deployment: the decode server, the connector and the testbed beside it on the same
   cores), keeping step 1's KV size, memory and pull.
4. The same experiment, same seeds, with the profile engine and that profile
   (`model.engine=profile`, `model.profile=<the calibrated file>`, accelerator cpu), at
   `--profile-scale` (the profile engine emulates the engine at any scale.time; 1 by default).

Prints per seed and engine the TTFT p50 / p90, the mean TPOT and the request throughput, then
the profile engine's figures over vLLM's (median over seeds and the spread). The issue asks within 10% on
TTFT p50 and p90 and within 5% on throughput over 3 seeds. Needs root and `make vllm`:

    sudo .venv/bin/python benchmarks/vllm_calibration.py --seeds 1,2,3 --out /tmp/vcal

`--smoke` calibrates with a short plan and runs one seed of 4 requests of each engine.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import rundir, vllmrun  # noqa: E402
from testbed.profiling import cost  # noqa: E402

EXPERIMENT = ROOT / "benchmarks" / "vllm_calibration.yaml"
SHORT_PLAN = ["--lengths", "128,512,1024", "--batches", "1,2", "--contexts", "128,512",
              "--steps", "8", "--repeats", "1", "--budget", "60"]
METRICS = ("median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "request_throughput")


def cli(*args):
    return [sys.executable, "-m", "testbed.cli", *args]


def calibrate(model, out, smoke, cpus, pair=True):
    """The profile of one server, bound as each instance of the runs will be (`auto`: one
    CPU each, so the calibration measures one CPU too); with `pair`, a decode server beside it
    (`auto`: on the other CPU) and the KV pull between the two (`kv_transfer: pull`)."""
    profile = out / "calibrated" / "cpu-llama.yaml"
    profile.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(cli("calibrate", "--engine", "vllm", "--model", str(model), "--out",
                       str(profile), "--max-model-len", "4096", "--lengths",
                       "256,512,1024,2048,3072", "--cpus", "0" if cpus == "auto" else cpus,
                       *(["--pair", "1" if cpus == "auto" else cpus] if pair else []),
                       *(SHORT_PLAN if smoke else [])), cwd=ROOT, check=True)
    return profile


def refit(base, runs, out):
    """The profile `base` refitted from the vLLM runs (`testbed calibrate --from-run`)."""
    profile = out / "calibrated" / "cpu-llama-deployed.yaml"
    subprocess.run(cli("calibrate", "--out", str(profile), "--base", str(base),
                       *[a for r in runs for a in ("--from-run", str(r))]), cwd=ROOT,
                   check=True)
    return profile


def run(out, sets):
    cost.timed_run(EXPERIMENT, out, sets, ROOT, probe=False)
    s = rundir.summary(out)
    ex = (s.get("emulation") or {}).get("ttft_excess_ms") or {}
    return {**{m: s.get(m) for m in METRICS}, "completed": s.get("completed", 0),
            "warnings": len(s.get("warnings") or []),
            "corrected_p50_ttft_ms": ex.get("ttft_corrected_p50"),
            "corrected_p90_ttft_ms": ex.get("ttft_corrected_p90")}


def sets(seed, n, cpus):
    return [f"seed={seed}", f"requests={n}", f"model.vllm.cpus={cpus}"]


def fmt(v):
    return "-" if v is None else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--profile-scale", type=float, default=1.0,
                    help="scale.time of the profile engine's runs")
    ap.add_argument("--cpus", choices=("nobind", "auto"), default="auto",
                    help="model.vllm.cpus of the runs (auto: each server one CPU, calibrated "
                         "on one CPU); nobind: every server on every CPU")
    ap.add_argument("--stream", action="store_true",
                    help="calibrate one server alone (no --pair): the profile streams the KV "
                         "during the prefill instead of pulling it after")
    ap.add_argument("--calib-seeds", default="100",
                    help="seeds of the vLLM runs the profile is refitted from (step 3)")
    ap.add_argument("--loopback", action="store_true",
                    help="skip step 3: the profile as calibrated on loopback")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--smoke", action="store_true", help="short plan, one seed, 4 requests")
    args = ap.parse_args()
    seeds = [1] if args.smoke else [int(x) for x in args.seeds.split(",")]
    n = 4 if args.smoke else args.requests
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="vllm-calibration-"))
    model = vllmrun.ensure_default_model()
    profile = calibrate(model, out, args.smoke, args.cpus, pair=not args.stream)
    if not args.loopback:
        calib = [int(x) for x in args.calib_seeds.split(",")]
        for seed in calib:
            run(out / f"vllm-calib-s{seed}", sets(seed, n, args.cpus))
        profile = refit(profile, [out / f"vllm-calib-s{s}" for s in calib], out)
    print(f"calibrated profile: {profile}", flush=True)
    rows = {}
    for seed in seeds:
        base = sets(seed, n, args.cpus)
        rows[("vllm", seed)] = run(out / f"vllm-s{seed}", base)
        rows[("profile", seed)] = run(out / f"profile-s{seed}", base + [
            "model.engine=profile", f"model.profile={profile}",
            "clusters.prfaas.accelerator=cpu", "clusters.local.accelerator=cpu",
            f"scale.time={args.profile_scale:g}"])
        for eng in ("vllm", "profile"):
            r = rows[(eng, seed)]
            print(f"seed {seed} {eng:<8} " + "  ".join(f"{m} {fmt(r[m])}" for m in METRICS)
                  + f"  completed {r['completed']}/{n}  warnings {r['warnings']}  without the "
                  f"emulation's excess: TTFT p50 {fmt(r['corrected_p50_ttft_ms'])}, p90 "
                  f"{fmt(r['corrected_p90_ttft_ms'])}", flush=True)
    print("\nprofile / vllm (median over seeds [min, max]; corrected_*: both without the "
          "emulation's own excess, summary.json emulation.ttft_excess_ms):")
    for m in METRICS + ("corrected_p50_ttft_ms", "corrected_p90_ttft_ms"):
        ratios = [rows[("profile", s)][m] / rows[("vllm", s)][m] for s in seeds
                  if rows[("profile", s)][m] and rows[("vllm", s)][m]]
        if ratios:
            print(f"  {m:<16} {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                  f"{max(ratios):.3f}]")
    (out / "calibration_check.json").write_text(json.dumps(
        {f"{e}-s{s}": r for (e, s), r in rows.items()}, indent=1))
    print(f"\n{out}")


if __name__ == "__main__":
    main()
