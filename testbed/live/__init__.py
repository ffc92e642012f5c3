"""Live: watch a run while it goes (issue 26).

- `state`: the run directory's live files tailed into one typed, real-world state;
- `exporter`: that state served to Prometheus with vLLM's metric names (a process of its own);
- `serve`: `--metrics PORT`, the exporter started and stopped beside the orchestrator;
- `view`: the live terminal view (rich), or the plain tqdm progress when stdout is not a
  terminal or under CI.

Nothing here writes into a run's records; the workers' status files (workers/status.py) are
written only while an exporter watches (`workers.status.STATUS_ENV`; their directory is
`RunDir.STATUS`).
"""
