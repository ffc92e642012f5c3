"""Two datacenters joined by one WAN router: the PrfaaS cluster and the local PD cluster.

    PrfaaS DC (10.1.0.0/16)                          local PD DC (10.2.0.0/16)
    rp0 rp1 ... prb --- sR ---[r] WAN router [l]--- sL --- lp0.. ld0.. sch cli plc

`sR` and `sL` are Linux bridges (no controller, no OVS). All inter-datacenter traffic crosses the
router host `wan`; its interface toward the local DC (`l`) is the egress of the KV direction,
its interface toward PrfaaS (`r`) the egress of the request direction. That is where the link
model is applied.

Node names carry the run's prefix so that several runs, and `testbed clean`, can tell whose
interfaces are whose; `roles` maps the logical name of each node to its Mininet name.
"""

from mininet.topo import Topo

REMOTE_NET = "10.1"
LOCAL_NET = "10.2"


class TwoDatacenterTopo(Topo):
    """Hosts: `rp<i>` PrfaaS prefill, `lp<i>` local prefill, `ld<i>` local decode, `scheduler`
    (`sch`), `client` (`cli`), with `cache` a prefix cache pool per DC (`rcp`, `lcp`),
    and one probe host per DC (`prb`, `plc`) for link measurements; router `wan`; switches `sR`, `sL`."""

    def build(self, prefix="tb", remote_prefill=1, local_prefill=1, local_decode=1, cache=False):
        self.prefix = prefix
        self.roles = {}
        self.ips = {}
        s_r = self._switch("sR")
        s_l = self._switch("sL")
        wan = self._host("wan", None)
        self.router_intfs = {"request": f"{prefix}wan-r", "kv": f"{prefix}wan-l"}
        self.addLink(wan, s_r, intfName1=self.router_intfs["request"],
                     params1={"ip": f"{REMOTE_NET}.0.1/16"})
        self.addLink(wan, s_l, intfName1=self.router_intfs["kv"],
                     params1={"ip": f"{LOCAL_NET}.0.1/16"})
        self.ips["wan-r"] = f"{REMOTE_NET}.0.1"
        self.ips["wan-l"] = f"{LOCAL_NET}.0.1"
        for i in range(remote_prefill):
            self._leaf(f"rp{i}", f"{REMOTE_NET}.1.{i + 1}", s_r)
        for i in range(local_prefill):
            self._leaf(f"lp{i}", f"{LOCAL_NET}.1.{i + 1}", s_l)
        for i in range(local_decode):
            self._leaf(f"ld{i}", f"{LOCAL_NET}.2.{i + 1}", s_l)
        # A probe host in each DC lets the run measure the WAN as built, whatever the policy.
        self._leaf("probe_remote", f"{REMOTE_NET}.0.9", s_r, short="prb")
        self._leaf("probe_local", f"{LOCAL_NET}.0.9", s_l, short="plc")
        self._leaf("scheduler", f"{LOCAL_NET}.0.2", s_l, short="sch")
        self._leaf("client", f"{LOCAL_NET}.0.3", s_l, short="cli")
        if cache:
            # One prefix cache pool per datacenter (docs/cache.md), on that DC's bridge: its
            # instances reach it over the unshaped intra-DC fabric, the other DC only over the WAN.
            self._leaf("pool_prfaas", f"{REMOTE_NET}.0.5", s_r, short="rcp")
            self._leaf("pool_local", f"{LOCAL_NET}.0.5", s_l, short="lcp")

    def _switch(self, role):
        # An explicit datapath id: Mininet derives one from digits in the name, and ours may have none.
        name = self.addSwitch(f"{self.prefix}{role}", dpid=f"{len(self.roles) + 1:016x}")
        self.roles[role] = name
        return name

    def _host(self, role, ip, gateway=None, short=None):
        # Interface names are <node>-eth<n> and the kernel allows 15 characters.
        kw = {"ip": ip} if ip else {"ip": None}
        if gateway:
            kw["defaultRoute"] = f"via {gateway}"
        name = self.addHost(f"{self.prefix}{short or role}", **kw)
        self.roles[role] = name
        return name

    def _leaf(self, role, ip, switch, short=None):
        gw = f"{ip.rsplit('.', 2)[0]}.0.1"
        h = self._host(role, f"{ip}/16", gw, short)
        self.ips[role] = ip
        self.addLink(h, switch)
        return h
