"""The testbed's processes: client, scheduler, prefill and decode workers (one OS process each,
inside its Mininet host), talking gRPC (testbed/proto/testbed.proto) for control and plain TCP
(workers/kvwire.py) for KV bytes. Each loads the run's `runtime.json` into the typed
`testbed.runtime.WorkerRuntime` (compiled by `testbed.deploy` from the validated experiment,
every time already emulated), never the YAML."""
