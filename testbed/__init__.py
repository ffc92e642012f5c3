"""PrfaaS cross-datacenter testbed.

The package follows the pipeline of an experiment:

    describe  ->  deploy  ->  build  ->  run  ->  measure  ->  analyse  ->  plot
    experiment.py deploy.py   backend/   run.py   measure.py   analysis.py  plot.py
    config.py     (compiled   net/       (process (kernel      metrics.py   (seaborn
    (read, expand, once)      (topology, supervision) counters) (pure)      figures)
     validate)                 shaping)

`config.load_experiment` is the only place YAML is read; everything after it receives the
validated, immutable `Experiment` object (or the resolved dict it was built from), and
`deploy.compile` turns each into the `Deployment` a backend runs. The run directory's file names
and record types live in `records.py` (light: the workers import it); analysis reads only the
run directory. Modules that span phases are split, one per floor: `faultspec` / `inject` /
`faults`, `loadgen` / `loadrun` / `loadstats`.

Layers only point down; the order is written once, in pyproject.toml `[tool.importlinter]`,
and checked by `lint-imports` (`make lint`, `make test`) and tests/test_layers.py.
"""

__version__ = "0.1.0"
