"""Mininet topologies: plain graph descriptions with no side effects (Mininet's `Topo` habit).
`testbed.net.build` makes them real."""
