"""The engine interface: what the prefill and decode workers ask of the thing that computes.

A worker (`workers/prefill.py`, `workers/decode.py`) does the serving: queues, KV transport,
continuous batching, health. The engine does the model's work, emulated from a profile
(`workers/engine_profile.py`) or real (`workers/engine_torch.py`). These Protocols are that
contract; the engines declare them as bases so a reader (and a type checker) sees which
capabilities each one has, and the workers ask `isinstance(engine, PacedDecodeEngine)` /
`AssemblingDecodeEngine` instead of probing attributes:

- `PrefillEngine`: every prefill engine (`ProfilePrefillEngine`; the torch engine behind
  `workers.prefill.TorchPrefill`, which adapts `TorchPrefillEngine.prefill`'s sender form).
- `DecodeEngine`: every decode engine (`ProfileDecodeEngine`, `TorchDecodeEngine`).
- `PacedDecodeEngine`: a decode engine that models time and memory rather than spending them
  (`ProfileDecodeEngine`): the worker paces steps by `step_seconds`, admits by `fits` and fails by `refusal`
  a request whose KV is larger than the whole decode memory.
- `AssemblingDecodeEngine`: a decode engine that assembles the shipped state itself
  (`TorchDecodeEngine`): KV frames go to `receive`, or are read in place via `frame_buffer`,
  and steps run off the event loop (`aemit_step`).

Units: every duration an engine takes or returns is emulated seconds; byte counts are
real-world where the name says `need` (decode memory) and emulated on the wire.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

Emit = Callable[[int, Any, bool], None]     # emit(seq, payload, last): one piece of KV is ready


@runtime_checkable
class PrefillEngine(Protocol):
    """Prefill one request, handing its KV to `emit` piece by piece as prefill progresses."""

    frames_checksummed: bool    # the KV pieces carry their own checksums (no kvwire crc32)
    clock_factor: float         # 1: profiled speed; the `slow` fault sets it (workers/control.py)

    async def prefill(self, request: Any, emit: Emit, arrived: float | None = None) -> dict:
        """Run (or emulate) the prefill; returns at least {"kv_bytes": bytes handed to emit},
        and "start" (Unix time) when compute started if that is not when the call came.
        `arrived`: when the request reached the instance (monotonic), for an engine that keeps
        its own schedule."""
        ...


@runtime_checkable
class DecodeEngine(Protocol):
    """Continuous-batching decode: requests are admitted, stepped together, released."""

    bs_max: int                 # the largest batch a step may hold
    step_s: float               # emulated seconds of a step when it has no model of its own
    clock_factor: float         # 1: profiled speed; the `slow` fault sets it (workers/control.py)

    def admit(self, request_id: int, state: Any = None) -> None:
        """A request whose KV is complete joins the engine (the worker batches it next)."""
        ...

    def step(self, request_ids: list[int]) -> dict:
        """One step for the batch: {request id: token id} ({} when no token ids are made)."""
        ...

    def release(self, request_id: int) -> None:
        """Free everything held for a request (finished, failed or abandoned)."""
        ...


@runtime_checkable
class PacedDecodeEngine(DecodeEngine, Protocol):
    """A decode engine that models step time and decode memory (the profile engine)."""

    def step_seconds(self, batch: int, context_tokens: int) -> float:
        """Emulated duration of one step of `batch` requests holding `context_tokens`."""
        ...

    def kv_need(self, input_len: int, output_len: int) -> float:
        """Real-world bytes a request holds in decode memory."""
        ...

    def fits(self, need: float) -> bool:
        """The request's KV fits beside the batch's now."""
        ...

    def refusal(self, need: float) -> str:
        """Why a request needing `need` can never join a batch ('' when it can)."""
        ...

    def reserve(self, need: float) -> None:
        ...

    def free(self, need: float) -> None:
        ...


@runtime_checkable
class AssemblingDecodeEngine(DecodeEngine, Protocol):
    """A decode engine that rebuilds the shipped state from the KV frames (the torch engine)."""

    def receive(self, request_id: int, seq: int, flags: int, payload: Any) -> None:
        ...

    def frame_buffer(self, request_id: int, seq: int, flags: int, length: int) -> Any:
        """A writable buffer the KV socket reads a data chunk into (no copy), or None."""
        ...

    def error(self, request_id: int) -> str | None:
        """Why a request's state could not be assembled, if it could not."""
        ...

    async def aemit_step(self, request_ids: list[int]) -> dict:
        """`step` off the event loop, emitting the token fed in (the first one prefill made)."""
        ...
