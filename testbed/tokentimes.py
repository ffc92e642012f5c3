"""Compact per-token times in the client's `requests.jsonl` (workers/client.py writes them,
testbed/rundir.read_records reads them back).

A request's `done` line carries every token's decode-worker stamp and its arrival at the client.
As JSON floats that is 2 x output_len numbers of ~18 digits, most of the client's encoding CPU.
The line holds instead:

- `token_t0`: the first token's decode stamp (Unix s) and `token_dus`: each stamp's step from
  the one before in integer microseconds (the first 0), rounded once against `token_t0` so the
  error does not accumulate (<= 0.5 us, below the clock's own resolution at Unix times);
- `client_chunks`: one [first token index, arrival time] pair per chunk received, since every
  token of a chunk arrives at once.

`expand` turns such a line back into `token_times` and `client_times` lists, so analysis reads
one format whichever wrote it (older lines hold the lists themselves).
"""

import itertools


def compact(token_times, chunks):
    """The line's fields for `token_times` (decode stamps) and `chunks` ([index, arrival])."""
    t0 = token_times[0] if token_times else None
    offsets = [round((t - t0) * 1e6) for t in token_times]
    return {"token_t0": t0, "token_dus": [b - a for a, b in zip([0] + offsets, offsets)],
            "client_chunks": chunks}


def expand(record):
    """`record` with `token_times` and `client_times` lists in place of the compact fields."""
    if "token_dus" not in record:
        return record
    t0 = record.pop("token_t0")
    offsets = itertools.accumulate(record.pop("token_dus"))
    token_times = [t0 + us * 1e-6 for us in offsets]
    chunks = record.pop("client_chunks")
    client_times = []
    for (i, t), (j, _) in zip(chunks, chunks[1:] + [[len(token_times), None]]):
        client_times.extend([t] * (j - i))
    record["token_times"], record["client_times"] = token_times, client_times
    return record
