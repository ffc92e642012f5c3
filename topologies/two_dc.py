"""Two datacenters joined by one WAN router: the PrfaaS cluster and the local PD cluster.

    PrfaaS DC (10.1.0.0/16)                          local PD DC (10.2.0.0/16)
    rp0 rp1 ... prb --- sR ---[r] WAN router [l]--- sL --- lp0.. ld0.. sch cli plc

`sR` and `sL` are Linux bridges (no controller, no OVS). All inter-datacenter traffic crosses the
router host `wan`; its interface toward the local DC (`l`) is the egress of the KV direction,
its interface toward PrfaaS (`r`) the egress of the request direction. That is where the link
model is applied.

Node names carry the run's prefix so that several runs, and `testbed clean`, can tell whose
interfaces are whose; `roles` maps the logical name of each node to its Mininet name.

The instances come from the run's `testbed.deploy.Deployment` (name, datacenter, address); this
module only places them on their datacenter's bridge and adds the router and the probe hosts.
"""

from mininet.topo import Topo

from testbed.deploy import DC_NET

REMOTE_NET = DC_NET["prfaas"]
LOCAL_NET = DC_NET["local"]
# Interface names are <node>-eth<n> and the kernel allows 15 characters: short node names.
SHORT = {"scheduler": "sch", "client": "cli", "pool_prfaas": "rcp", "pool_local": "lcp",
         "probe_remote": "prb", "probe_local": "plc"}


class TwoDatacenterTopo(Topo):
    """Hosts: one per deployed instance (`rp<i>` PrfaaS prefill, `lp<i>` local prefill, `ld<i>`
    local decode, `scheduler` (`sch`), `client` (`cli`), a prefix cache pool per DC when the
    cache is on (`rcp`, `lcp`)), and one probe host per DC (`prb`, `plc`) for link
    measurements; router `wan`; switches `sR`, `sL`."""

    def build(self, prefix="tb", instances=()):
        """`instances`: `testbed.runtime.InstanceRuntime`s (name, dc, ip) of the deployment."""
        self.prefix = prefix
        self.roles = {}
        self.ips = {}
        s_r = self._switch("sR")
        s_l = self._switch("sL")
        bridge = {"prfaas": s_r, "local": s_l}
        wan = self._host("wan", None)
        self.router_intfs = {"request": f"{prefix}wan-r", "kv": f"{prefix}wan-l"}
        self.addLink(wan, s_r, intfName1=self.router_intfs["request"],
                     params1={"ip": f"{REMOTE_NET}.0.1/16"})
        self.addLink(wan, s_l, intfName1=self.router_intfs["kv"],
                     params1={"ip": f"{LOCAL_NET}.0.1/16"})
        self.ips["wan-r"] = f"{REMOTE_NET}.0.1"
        self.ips["wan-l"] = f"{LOCAL_NET}.0.1"
        for inst in instances:
            self._leaf(inst.name, inst.ip, bridge[inst.dc])
        # A probe host in each DC lets the run measure the WAN as built, whatever the policy.
        self._leaf("probe_remote", f"{REMOTE_NET}.0.9", s_r)
        self._leaf("probe_local", f"{LOCAL_NET}.0.9", s_l)

    def _switch(self, role):
        # An explicit datapath id: Mininet derives one from digits in the name, and ours may have none.
        name = self.addSwitch(f"{self.prefix}{role}", dpid=f"{len(self.roles) + 1:016x}")
        self.roles[role] = name
        return name

    def _host(self, role, ip, gateway=None):
        kw = {"ip": ip} if ip else {"ip": None}
        if gateway:
            kw["defaultRoute"] = f"via {gateway}"
        name = self.addHost(f"{self.prefix}{SHORT.get(role, role)}", **kw)
        self.roles[role] = name
        return name

    def _leaf(self, role, ip, switch):
        gw = f"{ip.rsplit('.', 2)[0]}.0.1"
        h = self._host(role, f"{ip}/16", gw)
        self.ips[role] = ip
        self.addLink(h, switch)
        return h
