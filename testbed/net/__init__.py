"""The emulated network: topology builder, WAN shaping backends, kernel counters, link probes.

`build.py` turns a `topologies/` graph into Mininet hosts and LinuxBridge switches; `shaping.py`
puts the WAN link model on the router's two egress interfaces; `counters.py` samples what the
kernel counted on them. Everything here is driven through pyroute2 (netlink), never tc strings.
"""
