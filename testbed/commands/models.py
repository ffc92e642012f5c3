"""`testbed models`: the model catalog's KV size per request, S_kv(l), at 1K/8K/32K/128K.

Reads `testbed/models/*.yaml` through `testbed.catalog`; where the paper gives Phi_kv (one
8 x H200 instance) it also shows the prefill latency that implies. `--json` prints
`{"models": [...]}` with the same numbers.
"""

import json
import sys

from testbed import catalog, vllmenv


def register(subparsers):
    p = subparsers.add_parser(
        "models", help="KV bytes per request of the catalog models (S_kv at 1K..128K)",
        description="S_kv(l) of the architectures in PRFAAS.md, computed from the parameters "
                    "in testbed/models/*.yaml, and the prefill latency the paper's Phi_kv "
                    "implies.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--write", metavar="DIR",
                   help="write a small random-initialised Llama (GQA, float32, a local "
                        "tokenizer) that vLLM loads into DIR (model.engine vllm, "
                        "model.vllm.path; docs/vllm.md) and print its shape as JSON")
    p.add_argument("--layers", type=int, default=4, help="--write: hidden layers")
    p.add_argument("--seed", type=int, default=0, help="--write: weight seed")
    p.add_argument("--arch", choices=("llama", "qwen3_next"), default="llama",
                   help="--write: the dense Llama (float32), or qwen3_next, a Gated DeltaNet "
                        "hybrid (3 linear-attention layers to 1 full, bfloat16)")
    p.set_defaults(func=run)
    return p


def run(args):
    if args.write:
        return write(args.write, args.layers, args.seed, args.arch)
    rows = catalog.table()
    if args.json:
        print(json.dumps({"lengths": list(catalog.LENGTHS), "models": rows}, indent=2))
    else:
        print(render(rows))
    return 0


def write(out, layers, seed, arch="llama"):
    """The testbed's small random model for vLLM (testbed.vllmenv.write_model)."""
    try:
        print(vllmenv.write_model(out, layers, seed, arch))
    except vllmenv.ModelWriteError as e:
        print(f"testbed models --write {out}: {e}", file=sys.stderr)
        return 2
    return 0


def _k(l):
    return f"{int(l) // 1024}K"


def render(rows):
    ls = [str(l) for l in catalog.LENGTHS]
    name_w = max(len(r["model"]) for r in rows)
    head = (f"{'model':<{name_w}}  {'kind':<6} {'layers':>9} {'B/token':>8} {'state MiB':>9}  "
            + "  ".join(f"{'S_kv ' + _k(l):>10}" for l in ls) + "   "
            + "  ".join(f"{'T ' + _k(l):>7}" for l in ls))
    out = ["S_kv(l) in MiB per request; T = S_kv / Phi_kv(paper, 8 x H200) in s", "", head]
    for r in rows:
        s = "  ".join(f"{r['s_kv_mib'][l]:>10.1f}" for l in ls)
        implied = r["implied_prefill_s"] or {}
        t = "  ".join(f"{implied[l]:>7.2f}" if l in implied else f"{'-':>7}" for l in ls)
        layers = f"{r['full_attention_layers']}/{r['layers']}"
        flag = " *" if r["uncertain"] else ""
        out.append(f"{r['model']:<{name_w}}  {r['kind']:<6} {layers:>9} "
                   f"{r['bytes_per_token']:>8,d} {r['state_bytes'] / catalog.MIB:>9.1f}  "
                   f"{s}   {t}{flag}")
    out += ["", "layers = full-attention / all; * = uncertain numbers:"]
    out += [f"  {r['model']}: {u}" for r in rows for u in r["uncertain"]]
    return "\n".join(out)
