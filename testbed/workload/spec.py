"""The `workload:` section: arrivals, input and output lengths, shared prefixes, trace replay.

Describe only: these frozen dataclasses are validated by `testbed.schema` when the experiment is
loaded; `testbed.workload.generate` is the builder that turns them into the request list.

All rates, times and lengths are real-world; `scale` is applied by the runner when it schedules
sends. A `workload.trace` supplies what the other keys leave open: when it is set, an arrival
process or length distribution that is not given defaults to `trace` (the trace's own values), so
`workload: {trace: {path: ..., format: mooncake}}` replays the trace as it is.
"""

import dataclasses
import pathlib
import shlex

from testbed import units
from testbed.errors import ConfigError
from testbed.schema import (at_most, choice, integer, list_of, optional, positive, section, spec,
                            string)

BLOCK_TOKENS = 512  # tokens per prefix block, as in the Mooncake trace format (`hash_ids`)
MAX_DOCUMENTS = 100_000   # synthetic shared prefixes (a hard limit)


def _non_negative(parse):
    def p(value):
        x = parse(value)
        if x < 0:
            raise ValueError(f"expected a value >= 0, got {value!r}")
        return x

    return p


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArrivalSpec:
    process: str = spec(optional(choice("poisson", "gamma", "onoff", "constant", "trace")), None,
                        "poisson | gamma (bursty, as vllm bench serve) | onoff (Markov-modulated) "
                        "| constant | trace (the trace's timestamps); default: trace when "
                        "workload.trace is set, else poisson")
    rate: float = spec(optional(positive(units.per_s)), None,
                       "poisson, gamma, constant: mean arrival rate (real-world), e.g. 1.2/s")
    burstiness: float = spec(at_most(positive(units.number), 1000, "1000"), 1.0,
                             "gamma: shape of the gap distribution; CV = 1/sqrt(burstiness), "
                             "1 = poisson, < 1 burstier")
    on_rate: float = spec(optional(positive(units.per_s)), None,
                          "onoff: Poisson rate while on, e.g. 10/s")
    off_rate: float = spec(units.per_s, 0.0, "onoff: Poisson rate while off (default 0)")
    on_duration: float = spec(optional(positive(units.duration_s)), None,
                              "onoff: mean length of an on period (exponential), e.g. 5s")
    off_duration: float = spec(optional(positive(units.duration_s)), None,
                               "onoff: mean length of an off period (exponential), e.g. 20s")

    def check(self):
        p = self.process
        if p in ("poisson", "gamma", "constant") and self.rate is None:
            raise ValueError(f"process {p} needs 'rate'")
        if p in ("onoff", "trace") and self.rate is not None:
            hint = ("on_rate/off_rate" if p == "onoff"
                    else "workload.trace.speedup to change the trace's rate")
            raise ValueError(f"process {p} does not use 'rate'; use {hint}")
        if self.burstiness < 1e-3:
            raise ValueError(f"burstiness: expected at least 1e-3, got {self.burstiness:g}")
        if p == "onoff" and None in (self.on_rate, self.on_duration, self.off_duration):
            raise ValueError("process onoff needs 'on_rate', 'on_duration' and 'off_duration'")

    @property
    def mean_rate(self):
        """Long-run mean arrival rate (1/s) of a synthetic process; None for `trace`."""
        if self.process == "onoff":
            on, off = self.on_duration, self.off_duration
            return (self.on_rate * on + self.off_rate * off) / (on + off)
        return self.rate


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthSpec:
    dist: str = spec(optional(choice("lognormal", "fixed", "uniform", "empirical", "trace")), None,
                     "lognormal (mu, sigma of ln tokens, truncated to [min, max]) | fixed | "
                     "uniform | empirical (drawn from the trace's lengths) | trace (each row's "
                     "own); default: trace when workload.trace is set, else fixed")
    tokens: int = spec(optional(units.tokens), None, "fixed: the length")
    mu: float = spec(optional(units.number), None, "lognormal: mean of ln(tokens)")
    sigma: float = spec(optional(at_most(positive(units.number), 10, "10")), None,
                        "lognormal: std dev of ln(tokens) (at most 10)")
    min: int = spec(units.tokens, 1, "lognormal, uniform: smallest length (truncation / low end)")
    max: int = spec(units.tokens, 131072, "lognormal, uniform: largest length (truncation / high end)")

    def check(self):
        if self.min < 1:
            raise ValueError(f"min must be at least 1 token, got {self.min}")
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        if self.dist == "fixed" and self.tokens is None:
            raise ValueError("dist fixed needs 'tokens'")
        if self.dist == "fixed" and self.tokens < 1:
            raise ValueError(f"dist fixed needs tokens >= 1, got {self.tokens}")
        if self.dist == "lognormal" and (self.mu is None or self.sigma is None):
            raise ValueError("dist lognormal needs 'mu' and 'sigma'")
        if self.mu is not None and not -10 <= self.mu <= 30:
            raise ValueError(f"mu is ln(tokens): expected a value in [-10, 30], got {self.mu:g}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixSpec:
    """Synthetic prefix sharing: `documents` shared prefixes picked with Zipf popularity."""

    documents: int = spec(integer(0, MAX_DOCUMENTS), 0,
                          "number of shared prefixes (system prompts, documents); 0 = no sharing; "
                          "at most 100,000")
    zipf: float = spec(at_most(_non_negative(units.number), 100, "100"), 1.0,
                       "popularity exponent s: P(document k) ~ 1/k^s (0 = uniform)")
    length: int = spec(units.tokens, 4096,
                       "shared prefix length per request (tokens; whole 512-token blocks, at "
                       "most the request's input length)")
    share: float = spec(units.probability, 1.0,
                        "probability that a request starts with a shared document")

    def check(self):
        if self.documents > 0 and self.length < BLOCK_TOKENS:
            raise ValueError(f"length must be at least one {BLOCK_TOKENS}-token block, "
                             f"got {self.length}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceSpec:
    path: str = spec(string, doc="trace file; relative paths resolve against the experiment "
                                 "file's folder, then the working directory")
    format: str = spec(choice("mooncake", "azure"),
                       doc="mooncake (JSONL: timestamp ms, input_length, output_length, hash_ids) "
                           "| azure (CSV: TIMESTAMP, ContextTokens, GeneratedTokens)")
    start: float = spec(units.duration_s, 0.0,
                        "replay from this trace time on (seconds after the trace's first row)")
    duration: float = spec(optional(positive(units.duration_s)), None,
                           "replay this much trace time (default: to the end)")
    max_requests: int = spec(optional(integer(1)), None, "replay at most this many rows")
    speedup: float = spec(at_most(positive(units.number), 1e6, "1e6"), 1.0,
                          "divide the trace's gaps by this (2 = twice the load); real-world")
    max_input: int = spec(optional(positive(units.tokens)), None,
                          "clip input lengths (and prefix blocks) to this; clipped rows are "
                          "counted and reported")
    on_error: str = spec(choice("fail", "skip"), "fail",
                         "malformed or out-of-order line: fail (error naming the line) | skip "
                         "(drop it, count it, report the count)")


def _command(value):
    value = string(value)
    try:
        argv = shlex.split(value)
    except ValueError as e:
        raise ValueError(f"cannot split the command line ({e})") from None
    if not argv:
        raise ValueError("expected a command line, got an empty one")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontdoorSpec:
    """The OpenAI-compatible front door (workers/frontdoor.py) external clients drive."""

    port: int = spec(integer(1, 65535), 8000, "TCP port it listens on, in the client host")
    max_context: int = spec(positive(units.tokens), 131072,
                            "prompt + max_tokens above this is refused with HTTP 400 "
                            "context_length_exceeded (128Ki)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AiperfSpec:
    endpoint: str = spec(choice("completions", "chat"), "completions",
                         "aiperf --endpoint-type: /v1/completions or /v1/chat/completions")
    args: str = spec(optional(_command), None,
                     "more aiperf profile arguments (split like a shell), e.g. '--workers-max 2'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmBenchSpec:
    args: str = spec(optional(_command), None,
                     "more `vllm bench serve` arguments (split like a shell), e.g. "
                     "'--max-concurrency 4'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    """One phase of a workload whose mix shifts: what it sets replaces the base section."""

    until: float = spec(optional(positive(units.duration_s)), None,
                        "the phase ends at this time since the first arrival (real-world); "
                        "only the last phase may omit it (it lasts to the end)")
    arrival: ArrivalSpec = spec(optional(section(ArrivalSpec)), None,
                                "the arrival process in this phase (default: workload.arrival)")
    input: LengthSpec = spec(optional(section(LengthSpec)), None,
                             "input lengths in this phase (default: workload.input)")
    output: LengthSpec = spec(optional(section(LengthSpec)), None,
                              "output lengths in this phase (default: workload.output)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    client: str = spec(choice("builtin", "command", "aiperf", "vllm-bench", "none"), "builtin",
                       "builtin: the testbed's gRPC client sends the workload | command: "
                       "`workload.command` drives the OpenAI front door | aiperf: aiperf "
                       "replays the workload against it | vllm-bench: `vllm bench serve` (the vLLM venv) "
                       "sends the workload's count, rate and mean lengths to it | none: no load generator, the front "
                       "door serves whatever arrives (what `testbed up` runs; "
                       "docs/frontdoor.md)")
    command: str = spec(optional(_command), None,
                        "client command: a command line run in the client host, split like a "
                        "shell but not run by one; {url} (front door base URL, "
                        "http://IP:PORT), {model}, {trace} (the workload as a mooncake trace, "
                        "emulated ms) and {run_dir} are replaced")
    frontdoor: FrontdoorSpec = spec(section(FrontdoorSpec), factory=FrontdoorSpec,
                                    doc="the OpenAI-compatible front door (client command, aiperf)")
    aiperf: AiperfSpec = spec(section(AiperfSpec), factory=AiperfSpec,
                              doc="client aiperf: how aiperf is run")
    vllm_bench: VllmBenchSpec = spec(section(VllmBenchSpec), factory=VllmBenchSpec,
                                     doc="client vllm-bench: how `vllm bench serve` is run")
    trace: TraceSpec = spec(optional(section(TraceSpec)), None,
                            doc="a request trace to replay or sample from")
    arrival: ArrivalSpec = spec(section(ArrivalSpec), factory=ArrivalSpec, doc="when requests arrive")
    input: LengthSpec = spec(section(LengthSpec), factory=LengthSpec,
                             doc="input (prompt) length in tokens")
    output: LengthSpec = spec(section(LengthSpec), factory=LengthSpec,
                              doc="output length in tokens")
    prefix: PrefixSpec = spec(section(PrefixSpec), factory=PrefixSpec,
                              doc="synthetic shared prefixes (traces bring their own)")
    phases: tuple = spec(list_of(section(PhaseSpec)), (),
                         "a mix that shifts: [{until: 60s, input: {...}}, {input: {...}, "
                         "arrival: {...}}]; each phase's arrival/input/output replace the base "
                         "ones (keys below)")

    def __post_init__(self):
        # Fill the defaults that depend on whether a trace is given, so the resolved config
        # (config.yaml in the run directory) says what was generated.
        traced = self.trace is not None
        if self.arrival.process is None:
            object.__setattr__(self, "arrival", dataclasses.replace(
                self.arrival, process="trace" if traced else "poisson"))
        for name in ("input", "output"):
            if getattr(self, name).dist is None:
                object.__setattr__(self, name, dataclasses.replace(
                    getattr(self, name), dist="trace" if traced else "fixed"))

    def check(self):
        if self.client == "command" and self.command is None:
            raise ValueError("client command needs workload.command (the command line to run)")
        if self.command is not None and self.client != "command":
            raise ValueError(f"command is set but client is {self.client}; set client: command")
        for name in ("arrival", "input", "output"):
            try:
                getattr(self, name).check()
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        self._check_phases()
        uses = self.trace_uses()
        if self.trace is None and uses:
            raise ValueError(f"{' and '.join(uses)} need workload.trace")
        if self.trace is not None and not uses:
            raise ValueError("workload.trace is set but no arrival process or length "
                             "distribution is 'trace' or 'empirical'")
        if self.trace_prefixes() and self.prefix.documents > 0:
            raise ValueError("prefix.documents: the mooncake trace brings its own prefix "
                             "blocks (hash_ids); drop workload.prefix or use input.dist "
                             "empirical")

    def _check_phases(self):
        if not self.phases:
            return
        if self.trace is not None:
            raise ValueError("phases: not with workload.trace (synthetic workloads only)")
        prev = 0.0
        for k, ph in enumerate(self.phases):
            where = f"phases[{k}]"
            if ph.until is None and k != len(self.phases) - 1:
                raise ValueError(f"{where}: 'until' missing (only the last phase may omit it)")
            if ph.until is not None and ph.until <= prev:
                raise ValueError(f"{where}: until {ph.until:g}s must be after the previous "
                                 f"phase's end ({prev:g}s)")
            prev = ph.until or prev
            a, i, o = self.phase_specs(ph)
            if a.process not in ("poisson", "gamma", "constant"):
                raise ValueError(f"{where}: arrival process {a.process} (phases take poisson, "
                                 f"gamma or constant)")
            for name, sp in (("input", i), ("output", o)):
                if sp.dist not in ("fixed", "uniform", "lognormal"):
                    raise ValueError(f"{where}: {name} dist {sp.dist} (phases take fixed, "
                                     f"uniform or lognormal)")
                try:
                    sp.check()
                except ValueError as e:
                    raise ValueError(f"{where}.{name}: {e}") from None
            try:
                a.check()
            except ValueError as e:
                raise ValueError(f"{where}.arrival: {e}") from None

    def phase_specs(self, phase):
        """(arrival, input, output) in force during `phase` (a PhaseSpec)."""
        def fill(sp, base):
            if sp is None:
                return base
            if sp.dist is None:
                sp = dataclasses.replace(sp, dist="fixed")
            return sp

        arrival = phase.arrival if phase.arrival is not None else self.arrival
        if arrival.process is None:
            arrival = dataclasses.replace(arrival, process="poisson")
        return arrival, fill(phase.input, self.input), fill(phase.output, self.output)

    def trace_uses(self):
        """Which keys read the trace, e.g. ['arrival.process trace', 'input.dist empirical']."""
        out = []
        if self.arrival.process == "trace":
            out.append("arrival.process trace")
        for name in ("input", "output"):
            d = getattr(self, name).dist
            if d in ("trace", "empirical"):
                out.append(f"{name}.dist {d}")
        return out

    def trace_prefixes(self):
        """True when prefix blocks come from the trace (mooncake rows replayed in order)."""
        return (self.trace is not None and self.trace.format == "mooncake"
                and self.input.dist == "trace")

    def resolve_paths(self, base_dir):
        """A copy whose trace path is absolute: `base_dir`/path if it exists, else CWD/path.

        The experiment loader calls this with the experiment file's folder, so the resolved
        config names the file that was read. Raises ConfigError when neither exists.
        """
        if self.trace is None:
            return self
        path = resolve_trace_path(self.trace.path, base_dir)
        return dataclasses.replace(self, trace=dataclasses.replace(self.trace, path=str(path)))


def resolve_trace_path(path, base_dir=None):
    """The trace file `path` names: absolute as is; relative to `base_dir`, then to the CWD."""
    p = pathlib.Path(path).expanduser()
    candidates = [p] if p.is_absolute() else (
        ([pathlib.Path(base_dir) / p] if base_dir is not None else []) + [pathlib.Path.cwd() / p])
    for c in candidates:
        if c.is_file():
            return c.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"trace file not found (tried {tried})", key="workload.trace.path")
