"""Profiling one `testbed run` (benchmarks/profile_run.py): CPU per process, thread and role
from /proc (`sampler`), where the time goes inside the Python processes (`pyspy`), and the
report that puts both beside each variant's fidelity (`report`). Reads runs through
`testbed.rundir` only."""
