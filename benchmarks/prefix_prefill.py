"""Torch prefill time with a cached prefix vs from scratch, and the profile engine's formula.

For each (L, P) on the default tiny hybrid (CPU, fp32, 1 thread as in the workers): the time to
prefill L tokens from scratch, T(L), and to prefill tokens P..L continuing from the cached
prefix state of P tokens (`PrefixState`, MLA latents + KDA snapshot), alternated trials,
medians. The profile engine charges `T(L) - T(P)` for a request with P cached tokens; the table
puts the measured continued time next to that prediction (T() measured from scratch here).

    python benchmarks/prefix_prefill.py [--lengths 1024 2048 4096] [--trials 3]
    python benchmarks/prefix_prefill.py --smoke      # one short length, one trial: seconds
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from workers.model.config import HybridConfig  # noqa: E402
from workers.model.hybrid import HybridModel  # noqa: E402
from workers.model.prefix import PrefixState  # noqa: E402

SMOKE = {"lengths": [512], "block": 128, "trials": 1}    # --smoke: the same path in seconds


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE}: seconds")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    torch.set_num_threads(a.threads)
    cfg = HybridConfig()
    model = HybridModel(cfg)
    toks = torch.randint(0, cfg.vocab, (max(a.lengths),), generator=torch.Generator().manual_seed(0))
    scratch = {}

    def t_scratch(n):
        if n not in scratch:
            model.prefill(toks[:n])
            scratch[n] = statistics.median(timed(lambda: model.prefill(toks[:n]))
                                           for _ in range(a.trials))
        return scratch[n] if n else 0.0

    print(f"# tiny hybrid {cfg.layer_kinds}, width {cfg.d_model}, cpu fp32, torch "
          f"{torch.__version__}, {a.threads} thread(s), median of {a.trials} alternated trials")
    print("| L | P | T(L) scratch s | continued s | T(L)-T(P) s | measured / predicted | saved |")
    print("|---|---|---|---|---|---|---|")
    for L in a.lengths:
        Ps = sorted({b for b in (L // 4, L // 2, 3 * L // 4, L - a.block) if b % a.block == 0 and 0 < b < L})
        for P in Ps:
            _, st = model.prefill(toks[:P])
            prefix = PrefixState.from_state(st, P).request_state(cfg)
            cont, full = [], []
            for _ in range(a.trials):       # alternated: scratch, continued, scratch, ...
                full.append(timed(lambda: model.prefill(toks[:L])))
                cont.append(timed(lambda: model.prefill(toks[P:L], state=prefix)))
            tl = statistics.median(full)
            scratch[L] = tl
            tc = statistics.median(cont)
            pred = tl - t_scratch(P)
            print(f"| {L} | {P} | {tl:.3f} | {tc:.3f} | {pred:.3f} | {tc / pred:.2f} | "
                  f"{1 - tc / tl:.0%} |", flush=True)


if __name__ == "__main__":
    main()
