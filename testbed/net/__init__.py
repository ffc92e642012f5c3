"""The emulated network: experiment's `network:` section, topology builder, WAN shaping, link
schedule and link probes.

`spec.py` is the `network:` section (real-world units, validated once); `build.py` turns a
`topologies/` graph into Mininet hosts and LinuxBridge switches. The WAN link: `linkmodel.py` is
one direction's checked parameters (`Link`, `check_params`) and the queue arithmetic; `wan.py`
(`Wan`) puts it on the router's two egress interfaces (HTB + netem, or HTB + bfifo with
`firewall.py`'s iptables loss and `delayline.py`'s NFQUEUE delay line, `delayline.c`, where the
kernel has no netem); `netlink.py` is the one wrapper of pyroute2 requests (a refusal is a
`NetworkError` with the errno). `schedule.py` applies scheduled changes and rate traces while a
run goes on; `probe.py` measures the link as built, running `proberoles.py`'s senders and
receivers on its two ends. `pair.py` builds a link alone, between two namespaces or
src - router - dst with the same `Wan` (linktest, selfcheck, benchmarks); `ns.py` is the one way
to run a command inside a namespace. The kernel's counters on the WAN interfaces are sampled by
`testbed.measure.CounterSampler`.
"""
