"""The testbed's processes: client, scheduler, prefill and decode workers (one OS process each,
inside its Mininet host), talking gRPC (testbed/proto/testbed.proto) for control and plain TCP
(testbed/kvwire.py) for KV bytes. Each reads the run's `runtime.json`, written by the runner from
the validated experiment, never the YAML."""
