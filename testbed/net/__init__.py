"""The emulated network: experiment's `network:` section, topology builder, WAN shaping, link
schedule and link probes.

`spec.py` is the `network:` section (real-world units, validated once); `build.py` turns a
`topologies/` graph into Mininet hosts and LinuxBridge switches; `shaping.py` puts the WAN link
model on the router's two egress interfaces (HTB + netem, or HTB + bfifo + the `delayline.c`
NFQUEUE delay line where the kernel has no netem; qdiscs through pyroute2 netlink, loss and
link-down through iptables); `schedule.py` applies scheduled changes and rate traces while a run
goes on; `probe.py` measures the link as built. `pair.py` builds a link alone, between two
namespaces or src - router - dst with the same WAN model (linktest, selfcheck, benchmarks);
`ns.py` is the one way to run a command inside a namespace. The kernel's counters on the WAN interfaces are
sampled by `testbed.measure.CounterSampler`.
"""
