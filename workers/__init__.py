"""The testbed's processes: client, scheduler, prefill and decode workers (one OS process each,
inside its Mininet host), talking gRPC (testbed/proto/testbed.proto) for control and plain TCP
(workers/kvwire.py) for KV bytes. Each loads the run's `runtime.json` into the typed
`testbed.runtime.WorkerRuntime` (compiled by `testbed.deploy` from the validated experiment,
every time already emulated), never the YAML."""

# A test-only clock skew for this host's processes (testbed/clocks.py; nothing without
# TESTBED_CLOCK_SKEW_S in the environment, which only a Ray node of the root test sets).
from testbed.clocks import apply_test_skew as _apply_test_skew  # noqa: E402

_apply_test_skew()
