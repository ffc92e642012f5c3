"""Workloads: the list of requests an experiment sends (arrival times, lengths, prefixes).

Describe, then build: `spec.py` is the `workload:` section of the YAML (arrival process, length
distributions, synthetic prefix sharing, trace replay); `generate.py` turns it and the seed into
a deterministic request list (a pandas DataFrame, saved as `workload.parquet` in every run);
`traces.py` reads public traces (Mooncake JSONL, Azure CSV) for it; `prefix.py` makes and
scores chained 512-token prefix block ids. `testbed workload FILE` prints what a list is.
"""

from testbed.workload.generate import (COLUMNS, SUMMARY_KEYS, fingerprint,  # noqa: F401
                                       generate, summarize)
