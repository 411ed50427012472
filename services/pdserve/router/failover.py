"""Mid-stream failover: a request whose decode worker dies after its first token goes on elsewhere.

The router has streamed some tokens of the request to its client when the decode stream breaks
(the worker's connection is lost, it goes silent past the idle bound, it drops the ticket, or its
pool manager marks it FAILED). The request continues on another decode worker as a new *segment*:
its prompt is the original prompt plus every token delivered so far, and it asks only for the
tokens still missing (``resumed_request``). The segment takes the normal path (routing, a fresh
ticket with its own fencing token and lease, remote or local prefill); the dead worker's ticket
is aborted as for any failed attempt. Its first token is the next token of the stream, so the
client sees one stream, nothing repeated, nothing missing.

Why re-prefill rather than pull the dead worker's KV: the KV died with the worker (its memory,
or its process); recomputing prompt + delivered tokens costs one prefill, and prefill is the
pool built for it.

Output: greedy decoding gives exactly the tokens the uninterrupted stream would have had, given
an engine whose prefill of a sequence reproduces the KV its decode steps wrote (the tiny engine
does; real engines agree up to floating-point summation order, so a near tie may go the other
way). A *sampled* request's continuation is a fresh draw from the model conditioned on the tokens
delivered, not the draw the dead worker would have made. With a seed, the continuation's seed is
derived from the seed and the number of tokens delivered (``resumed_seed``): it does not replay
the random stream from its start (which would correlate the continuation with the beginning),
and a request that fails over at the same point twice continues the same way. Without a seed
(0) it stays unseeded.

Bounds (``FailoverLimits``, router settings): at most ``max_failovers`` failovers per request and
``max_failover_s`` of extra time in all (from each break to the resumed stream's next token).
Beyond them, or when no decode worker can take the segment, the client gets UNAVAILABLE naming
the request id and how many tokens it was sent (``gave_up``).

The same continuation serves a client whose router replica died: it sends the request again to
another replica with the tokens it received (``GenerateRequest.resume_token_ids``), and that
router starts the request at a resumed segment.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.common.errors import PdserveError, UnavailableError
from pdserve.router.types import GenerationRequest

_NOT_RESUMABLE = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.OUT_OF_RANGE,
})
"""Stream failures that another worker would repeat (the request itself is at fault)."""


class FailoverOutcome(enum.StrEnum):
    """How one failover ended (the ``outcome`` label of the failover counter)."""

    RESUMED = "resumed"
    """The stream went on: the next token came from another decode worker."""
    MAX_FAILOVERS = "max_failovers"
    """The request had failed over ``max_failovers`` times already."""
    MAX_TIME = "max_time"
    """Its failovers took ``max_failover_s`` in all before a next token came."""
    NO_WORKER = "no_worker"
    """Every attempt at the continuation failed before its first token (or none could be
    routed)."""
    CANCELLED = "cancelled"
    """The client went away (or cancelled) while the request was failing over."""


@dataclass(frozen=True, slots=True)
class FailoverLimits:
    """Bounds on one request's mid-stream failovers."""

    max_failovers: int = 3
    """Failovers allowed per request; 0 = a broken stream ends the request (UNAVAILABLE)."""
    max_failover_s: float = 30.0
    """Extra time all failovers of one request may take, seconds: each counts from the break to
    the next token from the new worker."""


def is_resumable(error: PdserveError) -> bool:
    """Whether a stream that broke with ``error`` may continue on another worker: anything that
    is the worker's fault (gone, silent, dropped the ticket, failed), not the request's."""
    return error.code not in _NOT_RESUMABLE


def resumed_seed(seed: int, num_delivered: int) -> int:
    """The sampling seed of a continuation after ``num_delivered`` tokens: 0 (unseeded) stays 0;
    otherwise a 63-bit, nonzero function of both (module docstring: why not ``seed`` itself)."""
    if seed == 0 or num_delivered == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{num_delivered}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def resumed_request(request: GenerationRequest, delivered_token_ids: tuple[int, ...]
                    ) -> GenerationRequest:
    """The segment that continues ``request`` after ``delivered_token_ids``: those tokens
    appended to the prompt, ``max_tokens`` what is still missing (may be 0: nothing left to
    generate), the seed moved on (``resumed_seed``). No resume data of its own."""
    if not delivered_token_ids:
        return dataclasses.replace(request, resume_token_ids=())
    return dataclasses.replace(
        request,
        prompt_token_ids=request.prompt_token_ids + delivered_token_ids,
        max_tokens=request.max_tokens - len(delivered_token_ids),
        seed=resumed_seed(request.seed, len(delivered_token_ids)),
        resume_token_ids=(),
    )


class FailoverBudget:
    """One request's failovers so far against ``FailoverLimits``; ``clock`` is monotonic s."""

    def __init__(self, limits: FailoverLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self.num_failovers = 0
        self._spent_s = 0.0
        self._broke_at_s: float | None = None

    @property
    def is_failing_over(self) -> bool:
        """A break happened and no token has come from the new worker yet."""
        return self._broke_at_s is not None

    def remaining_s(self) -> float:
        """Extra time left to the current failover (all of it when none is running)."""
        spent = self._spent_s
        if self._broke_at_s is not None:
            spent += self._clock() - self._broke_at_s
        return self.limits.max_failover_s - spent

    def begin(self) -> FailoverOutcome | None:
        """A stream broke: start a failover, or the outcome that forbids it."""
        if self.num_failovers >= self.limits.max_failovers:
            return FailoverOutcome.MAX_FAILOVERS
        if self.remaining_s() <= 0:
            return FailoverOutcome.MAX_TIME
        self.num_failovers += 1
        self._broke_at_s = self._clock()
        return None

    def settle(self) -> None:
        """The failover ended (the next token came, or it gave up): its time is spent."""
        if self._broke_at_s is not None:
            self._spent_s += self._clock() - self._broke_at_s
            self._broke_at_s = None


def gave_up(request_id: str, num_delivered: int, outcome: FailoverOutcome,
            cause: PdserveError | None) -> UnavailableError:
    """The clean error of a request whose stream could not go on."""
    why = {
        FailoverOutcome.MAX_FAILOVERS: "it had failed over the most times allowed "
                                       "(max_failovers)",
        FailoverOutcome.MAX_TIME: "its failovers took longer than allowed (max_failover_s)",
        FailoverOutcome.NO_WORKER: "no decode worker could take the continuation",
    }.get(outcome, str(outcome))
    detail = f": {cause.message}" if cause is not None and cause.message else ""
    return UnavailableError(
        f"request {request_id}: the stream broke after {num_delivered} tokens were delivered "
        f"and could not go on: {why}{detail}")
