"""PrfaaS cross-datacenter testbed.

The package follows the pipeline of an experiment:

    describe  ->  build  ->  run  ->  measure  ->  analyse  ->  plot
    config.py     net/       run.py   measure.py   metrics.py   plot.py
    (schema,      (topology, (process (kernel      (summary,    (seaborn
     units)        shaping)   supervision) counters)  planner)     figures)

`config.load_experiment` is the only place YAML is read; everything after it receives the
validated, immutable `Experiment` object (or the resolved dict it was built from).
"""

__version__ = "0.1.0"
