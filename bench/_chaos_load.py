"""Open-loop load for the chaos harness, and the client's verdict on every request.

Arrivals are Poisson (open loop: a slow or failing server does not slow the arrivals). The
client is what a gRPC client of a replicated service does: one channel balanced round-robin over
the router replicas (``channel_target``: calls go to replicas that are up), and a call that
failed UNAVAILABLE before any response is repeated (it is safe to) after a jittered backoff; one
that failed UNAVAILABLE after some tokens (its router replica died mid-stream) is resumed on a
replica that is up with the same request id and the tokens received (``resume_token_ids``). It
counts the tokens and classifies the end (``tests/e2e/faults.Outcome``; a resumed stream that
got every token is ``completed``):

- ``completed``: every token asked for, then a clean end;
- ``failed``: a gRPC status (a clean failure; RESOURCE_EXHAUSTED with no token is a refusal at
  admission, not an accepted request);
- ``truncated``: a clean end with fewer tokens than asked (must never happen);
- ``duplicated``: more tokens than asked, over all its tries (a token repeated across a failover
  or a resume; must never happen);
- ``hung``: no end within 60 s (must never happen);
- ``client_error``: anything else the client raised (a bug in the harness or the stack).

(``faults.Load`` picks a replica per try from a counter all requests in flight share, so under
open-loop load one request can spend all its tries on a killed router; hence this client.)
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

import _chaos_stack  # noqa: F401 - puts tests/ on sys.path
import grpc
from e2e.faults import HANG_S, MODEL, Outcome

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import router_pb2, router_pb2_grpc
from pdserve.common.grpc_client import channel_target

PROMPT_ALPHABET = "abcdefghijklmnopqrstuvwxyz     "
CLIENT_TRIES = 8
"""Tries of a call refused UNAVAILABLE before any response (backoff 0.05 s doubling to 1 s)."""


class OpenLoopLoad:
    """Poisson arrivals at ``rate_rps`` over the router replicas from ``start`` to ``stop``."""

    def __init__(self, router_addresses: list[str], rate_rps: float, *,
                 prompt_tokens: tuple[int, int] = (100, 1500), max_tokens: int = 32,
                 seed: int = 7) -> None:
        self.rate_rps = rate_rps
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self.num_sent = 0
        self._rng = random.Random(seed)
        self._jitter = random.Random(seed + 1)
        self._target, self._options = channel_target(",".join(router_addresses))
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterServiceStub | None = None
        self._stop = asyncio.Event()
        self._arrivals: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def start(self) -> OpenLoopLoad:
        self._channel = grpc.aio.insecure_channel(self._target, options=self._options or None)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._arrivals = asyncio.create_task(self._arrive())
        return self

    async def stop(self) -> list[Outcome]:
        """No more arrivals; waits for every request in flight (each ends within the hang
        bound)."""
        self._stop.set()
        if self._arrivals is not None:
            await self._arrivals
        if self._in_flight:
            await asyncio.gather(*self._in_flight)
        if self._channel is not None:
            await self._channel.close()
        return self.outcomes

    async def _arrive(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self._rng.expovariate(self.rate_rps)
            delay = next_at - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                    return
                except TimeoutError:
                    pass
            num_tokens = self._rng.randint(*self.prompt_tokens)
            prompt = "".join(self._rng.choices(PROMPT_ALPHABET, k=num_tokens))
            task = asyncio.create_task(self._one(prompt, f"chaos-{uuid.uuid4().hex[:12]}"))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            self.num_sent += 1

    async def _one(self, prompt: str, request_id: str) -> None:
        started = time.monotonic()
        try:
            outcome = await asyncio.wait_for(self._tries(prompt, request_id, started), HANG_S)
        except TimeoutError:
            outcome = Outcome(request_id, "hung", "", 0, 0, started, time.monotonic())
        except Exception as exc:  # noqa: BLE001 - the verdict, not a crash of the load
            outcome = Outcome(request_id, "client_error", type(exc).__name__, 0, 0, started,
                              time.monotonic(), str(exc)[:200])
        self.outcomes.append(outcome)

    async def _tries(self, prompt: str, request_id: str, started: float) -> Outcome:
        assert self._stub is not None, "not started"
        request = router_pb2.GenerateRequest(
            request_id=request_id, model=MODEL, prompt=prompt,
            sampling=pb.SamplingParams(max_tokens=self.max_tokens))
        received: list[int] = []
        num_resumes = 0
        for tries in range(1, CLIENT_TRIES + 1):
            if not received:  # a resume keeps the id of the stream it continues
                request.request_id = f"{request_id}-{tries}"
            request.resume_token_ids[:] = received
            num_resumes += bool(received)
            num_before = len(received)
            last = None
            try:
                async for chunk in self._stub.Generate(request, timeout=HANG_S + 5):
                    received.extend(chunk.token_ids)
                    last = chunk
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE and tries < CLIENT_TRIES:
                    # Nothing answered: safe to repeat (on whichever replica is up); tokens
                    # answered: the replica died mid-stream, resume at once where it stopped.
                    if len(received) == num_before:
                        await asyncio.sleep(min(1.0, 0.05 * 2 ** (tries - 1))
                                            * self._jitter.uniform(0.5, 1.5))
                    continue
                return Outcome(request_id, "failed", exc.code().name, len(received), tries,
                               started, time.monotonic(), exc.details() or "", num_resumes)
            is_complete = (last is not None and len(received) == self.max_tokens
                           and last.finish_reason == pb.FINISH_REASON_LENGTH)
            kind = ("completed" if is_complete else
                    "duplicated" if len(received) > self.max_tokens else "truncated")
            return Outcome(request_id, kind, "", len(received), tries, started,
                           time.monotonic(), "", num_resumes)
        raise AssertionError("unreachable: the last try returns")

    async def wait_for_success_after(self, since_s: float, timeout_s: float = HANG_S
                                     ) -> float | None:
        """Seconds from ``since_s`` (time.monotonic()) to the end of the first request that
        started at or after it and completed; None if none within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = [o.ended_s for o in self.outcomes
                    if o.started_s >= since_s and o.kind == "completed"]
            if done:
                return min(done) - since_s
            await asyncio.sleep(0.05)
        return None


def is_refused(outcome: Outcome) -> bool:
    """Refused at admission (shed): not an accepted request."""
    return outcome.kind == "failed" and outcome.code == "RESOURCE_EXHAUSTED" \
        and outcome.num_tokens == 0


@dataclass(frozen=True, slots=True)
class Counts:
    """Requests by verdict."""

    sent: int
    refused: int
    accepted: int
    completed: int
    failed_clean: int
    hung: int
    truncated: int
    client_errors: int
    tokens: int
    duplicated: int = 0
    """More tokens than asked (a token repeated across a failover or resume)."""
    resumed: int = 0
    """Accepted requests whose client resumed the stream on another replica (completed or not)."""

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> Counts:
        refused = sum(is_refused(o) for o in outcomes)
        return cls(
            sent=len(outcomes), refused=refused, accepted=len(outcomes) - refused,
            completed=sum(o.kind == "completed" for o in outcomes),
            failed_clean=sum(o.kind == "failed" for o in outcomes) - refused,
            hung=sum(o.kind == "hung" for o in outcomes),
            truncated=sum(o.kind == "truncated" for o in outcomes),
            client_errors=sum(o.kind == "client_error" for o in outcomes),
            tokens=sum(o.num_tokens for o in outcomes),
            duplicated=sum(o.kind == "duplicated" for o in outcomes),
            resumed=sum(o.num_resumes > 0 for o in outcomes),
        )


def overlapping(outcomes: list[Outcome], start_s: float, end_s: float) -> list[Outcome]:
    """Requests in flight at some time in ``[start_s, end_s]``."""
    return [o for o in outcomes if o.started_s <= end_s and o.ended_s >= start_s]
