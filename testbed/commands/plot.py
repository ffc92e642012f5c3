"""`testbed plot RUN_DIR`: (re)draw a run directory's figures from what it holds, nothing else.

`--style paper` draws the paper figures instead (testbed/plot_paper.py): vector PDFs with
embedded TrueType fonts at 3.3 in and 7 in, in figures/paper/, and figures/captions.md.
"""

import pathlib

from testbed import ownership, plot, plot_paper, rundir
from testbed.errors import ConfigError


def register(sub):
    p = sub.add_parser("plot", help="draw the figures of a run directory")
    p.add_argument("run_dir", help="a run directory (or an experiment's top directory)")
    p.add_argument("--style", choices=("screen", "paper"), default="screen",
                   help="screen: the run's usual PNG+PDF figures | paper: vector PDFs at a "
                        "paper's column widths with caption stubs")
    p.set_defaults(func=main)


def main(args):
    d = pathlib.Path(args.run_dir)
    if not rundir.find_runs(d):
        raise ConfigError("no summary.json here or one level below: not a run directory (a "
                          "killed run: `testbed analyse` it first)", path=str(d))
    try:
        paths = plot_paper.paper_figures(d) if args.style == "paper" else plot.run_figures(d)
    finally:    # under sudo, the figures (only ever made by the testbed) go to the invoking user
        ownership.hand_back(rundir.RunDir(d).figures)
    for path in paths:
        print(path)
    return 0
