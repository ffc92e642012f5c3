"""Pull-after-prefill KV transfer: the profile engine as a connector that pulls (NixlConnector).

A profile with `kv_transfer: pull` (testbed/profile.py) changes when the prefill worker's
sender (`workers.prefill.PrefillService._send_once`) puts the KV on the wire. With `stream`
(the default, the PrfaaS design) the pieces go out as the prefill produces them, so only the
transfer's tail is left when the compute ends. With `pull` nothing goes out before the prefill
has ended; then the decode instance's pull request has to cross the link before the data does,
and the connector's own per-transfer work (the pull's set-up, its completion notice, the
decode server's bookkeeping) comes on top; then the whole KV crosses the link. vLLM's
NixlConnector works so: the decode instance reads the finished blocks from the prefill
instance.

What the sender waits, after the last piece is ready and before the first byte goes out:

- one round trip of the real link: the kernel's minimum RTT of this very KV connection
  (TCP_INFO `tcpi_min_rtt`, what its segments and acknowledgements took on the emulated
  WAN, queueing left out), so that the pull request's way over and the data's way back are
  both the link's; not a configured number: a slower or longer WAN gives a longer wait;
- `kv_pull_latency` (the profile; seconds of the real engine, divided by scale.time): the
  connector's fixed cost per transfer, which `testbed calibrate --pair` measures between two
  servers (docs/vllm.md "Calibration").

The bytes then cross the link at its rate (not modelled here: they are sent).
"""

import asyncio
import socket
import struct

# struct tcp_info (linux/tcp.h): tcpi_rtt (smoothed, us) at byte 68, tcpi_min_rtt (us) at 148.
_RTT_AT, _MIN_RTT_AT = 68, 148


def link_rtt_s(sock):
    """The connection's minimum RTT the kernel measured, seconds (the smoothed RTT where the
    kernel gives no minimum; 0 when it says nothing: a socket that is not TCP)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    except (OSError, AttributeError):
        return 0.0
    if len(raw) >= _MIN_RTT_AT + 4:
        (min_rtt,) = struct.unpack_from("I", raw, _MIN_RTT_AT)
        if 0 < min_rtt < 0xFFFFFFFF:
            return min_rtt / 1e6
    if len(raw) >= _RTT_AT + 4:
        return struct.unpack_from("I", raw, _RTT_AT)[0] / 1e6
    return 0.0


async def whole(queue, first):
    """`first` and every frame after it up to the last (None on abort): a pull sends nothing
    before the prefill has produced all of its KV."""
    batch = list(first)
    while batch[-1] is not None and not batch[-1][2]:
        batch.append(await queue.get())
    return None if batch[-1] is None else batch


async def wait_pull(conn, latency_s):
    """The pull request's round trip on `conn`'s link and the connector's per-transfer cost;
    returns the seconds waited (the round trip measured, plus `latency_s`)."""
    wait_s = link_rtt_s(getattr(conn, "sock", None)) + latency_s
    if wait_s > 0:
        await asyncio.sleep(wait_s)
    return wait_s
