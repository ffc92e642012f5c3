"""Workloads: the list of requests an experiment sends (arrival times, lengths, prefixes).

`spec.py` is the `workload:` section of the YAML; `generate.py` turns it and the seed into a
deterministic request list (a pandas DataFrame, saved as `workload.parquet` in every run).
"""

from testbed.workload.generate import generate, summarize  # noqa: F401
