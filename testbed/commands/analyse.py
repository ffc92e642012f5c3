"""`testbed analyse RUN_DIR`: (re)build requests.parquet and summary.json from a run's records.

Works on any run directory, in particular one whose `testbed run` was killed (SIGKILL, a closed
terminal, a crash) and so never analysed itself, and on one copied from another machine: the
Experiment is read back from the saved config.yaml, the requests from workload.parquet and the
client's requests.jsonl, the link from timeseries.csv and events.csv (`testbed.rundir`). The
summary says `incomplete: true` and why, and counts requests never finished (`not_finished`)
and never sent (`not_sent`) as failed. Then the figures are redrawn. Under sudo, the run
directory is handed to the invoking user (SUDO_UID): a killed run never got to do that itself.
"""

import pathlib

from testbed import analysis, ownership, plot, rundir
from testbed.errors import ConfigError


def register(sub):
    p = sub.add_parser("analyse", help="rebuild requests.parquet and summary.json of a run "
                                       "directory (also of a killed run)")
    p.add_argument("run_dir", help="a run directory (or an experiment's top directory)")
    p.set_defaults(func=main)


def main(args):
    top = pathlib.Path(args.run_dir)
    if not top.is_dir():
        raise ConfigError("not a directory; expected a run directory", path=str(top))
    runs = rundir.find_recorded_runs(top)
    if not runs:
        raise ConfigError("no config.yaml here or one level below: not a run directory",
                          path=str(top))
    try:
        summaries = [analysis.analyse(d) for d in runs]
        if len(runs) > 1 or top not in runs:
            analysis.write_sweep(top, summaries)
        plot.run_figures(top)
    finally:
        ownership.hand_back(top)
    for d, s in zip(runs, summaries):
        state = f"incomplete: {s['incomplete_reason']}" if s.get("incomplete") else "complete"
        print(f"{s['label']}: {s['completed']} completed, {s['failed']} failed "
              f"({s['not_finished']} sent but not finished, {s['not_sent']} never sent); "
              f"{state}")
        print(rundir.RunDir(d).summary)
    return 0
