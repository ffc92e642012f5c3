"""Hit share of one global hybrid prefix pool per KDA snapshot policy, on an experiment's requests.

Replays the experiment's request list in arrival order against one unbounded
`workers.cache_core.BlockStore`: each request continues from its longest prefix of cached whole
blocks ending at a snapshot, then stores its new blocks and the snapshots the policy keeps
(`snapshot_blocks`). Prints the hit share per `cache.snapshot_every` beside the ideal (any
block, `testbed workload`). No network: it isolates what the snapshot policy costs
(docs/cache.md).

    .venv/bin/python benchmarks/cache_snapshots.py [experiments/prefix_cache_mooncake.yaml] [--set k=v]
    .venv/bin/python benchmarks/cache_snapshots.py --smoke      # the first 300 requests only
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.config import load_experiment  # noqa: E402
from testbed.workload import generate  # noqa: E402
from testbed.workload.prefix import hit_tokens  # noqa: E402
from workers.cache_core import KIND_KV, KIND_STATE, BlockStore, snapshot_blocks  # noqa: E402

SMOKE_SETS = ["requests=300"]


def replay(blocks, lengths, every, block=512):
    store, hits = BlockStore(1 << 62), 0
    for ids, length in zip(blocks, lengths):
        ids = list(ids)
        n = min(length // block, len(ids))
        _, state = store.match(ids[:n])
        state = min(state, (length - 1) // block)
        hits += state * block
        for i in range(state, n):
            store.put(ids[i], KIND_KV, b"")
        for k in snapshot_blocks(n, every):
            if k > state:
                store.put(ids[k - 1], KIND_STATE, b"")
    return hits


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?",
                   default=str(ROOT / "experiments" / "prefix_cache_mooncake.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--smoke", action="store_true", help=f"only {SMOKE_SETS}: seconds")
    args = p.parse_args()
    exp = load_experiment(args.file, args.overrides + (SMOKE_SETS if args.smoke else []))[0]
    df = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration,
                  base_dir=pathlib.Path(args.file).parent)
    lengths = df.input_len.to_numpy()
    total = lengths.sum()
    print(f"{len(df)} requests, {total:,} input tokens")
    print(f"ideal (any block, unbounded): {hit_tokens(list(df.prefix_blocks), lengths).sum() / total:.1%}")
    for every in (0, 16, 8, 4, 1):
        share = replay(df.prefix_blocks, lengths.tolist(), every) / total
        print(f"snapshot_every {every:>2}: {share:.1%}")


if __name__ == "__main__":
    main()
