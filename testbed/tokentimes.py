"""Compact per-token times in the client's `requests.jsonl` (workers/client.py writes them,
testbed/records.read_records reads them back).

A request's `done` line carries every token's decode-worker stamp and its arrival at the client.
As JSON floats that is 2 x output_len numbers of ~18 digits, most of the client's encoding CPU.
The line holds instead:

- `token_dus`: each decode stamp in integer Unix microseconds, the first as it is and each
  later one as its step from the one before. Every stamp is rounded to the microsecond on one
  absolute grid, so the error does not accumulate (<= 0.5 us) and the tokens one decode step
  emitted for several requests still carry one and the same time (testbed/metrics.decode_steps
  finds the steps by that equality);
- `client_chunks`: one [first token index, arrival time] pair per chunk received, since every
  token of a chunk arrives at once.

`expand` turns such a line back into `token_times` and `client_times` lists, so analysis reads
one format whichever wrote it (older lines hold the lists themselves).
"""

import itertools


def compact(token_times, chunks):
    """The line's fields for `token_times` (decode stamps) and `chunks` ([index, arrival])."""
    us = [round(t * 1e6) for t in token_times]
    return {"token_dus": [b - a for a, b in zip([0] + us, us)], "client_chunks": chunks}


def expand(record):
    """`record` with `token_times` and `client_times` lists in place of the compact fields."""
    if "token_dus" not in record:
        return record
    token_times = [us / 1e6 for us in itertools.accumulate(record.pop("token_dus"))]
    chunks = record.pop("client_chunks")
    client_times = []
    for (i, t), (j, _) in zip(chunks, chunks[1:] + [[len(token_times), None]]):
        client_times.extend([t] * (j - i))
    record["token_times"], record["client_times"] = token_times, client_times
    return record
