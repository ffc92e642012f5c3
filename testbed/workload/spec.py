"""The `workload:` section: arrival process, input and output length distributions.

All rates and lengths are real-world; `scale` is applied by the runner when it schedules sends.
"""

import dataclasses

from testbed import units
from testbed.schema import choice, optional, positive, section, spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArrivalSpec:
    process: str = spec(choice("poisson", "gamma", "constant"), "poisson",
                        "poisson | gamma (bursty) | constant")
    rate: float = spec(positive(units.per_s), 1.0, "mean arrival rate (real-world), e.g. 1.2/s")
    burstiness: float = spec(positive(units.number), 1.0,
                             "gamma only: shape of the gap distribution (CV = 1/sqrt(burstiness))")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthSpec:
    dist: str = spec(choice("lognormal", "fixed", "uniform"), "fixed",
                     "lognormal (mu, sigma of ln tokens, truncated to [min, max]) | fixed | uniform")
    tokens: int = spec(optional(units.tokens), None, "fixed: the length")
    mu: float = spec(optional(units.number), None, "lognormal: mean of ln(tokens)")
    sigma: float = spec(optional(positive(units.number)), None, "lognormal: std dev of ln(tokens)")
    min: int = spec(units.tokens, 1, "smallest length (truncation / uniform low end)")
    max: int = spec(units.tokens, 131072, "largest length (truncation / uniform high end)")

    def check(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        if self.dist == "fixed" and self.tokens is None:
            raise ValueError("dist fixed needs 'tokens'")
        if self.dist == "lognormal" and (self.mu is None or self.sigma is None):
            raise ValueError("dist lognormal needs 'mu' and 'sigma'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    arrival: ArrivalSpec = spec(section(ArrivalSpec), factory=ArrivalSpec, doc="when requests arrive")
    input: LengthSpec = spec(section(LengthSpec), doc="input (prompt) length in tokens")
    output: LengthSpec = spec(section(LengthSpec), doc="output length in tokens")
