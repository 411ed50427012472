"""Where simulated requests come from: the rows of a trace in arrival order, read in chunks of
plain lists (indexing a Python list is far cheaper than a numpy scalar, and a chunk bounds the
memory), each request with what its client asks for (``max_tokens``) and the KV reservation
the router would size for it."""

from __future__ import annotations

from collections.abc import Iterator

from pdserve.router.policy import RouteRequest, RoutingConfig, num_blocks_to_reserve
from pdserve.sim.state import SimRequest
from pdserve.sim.traces import Trace, iter_chunks

CHUNK_REQUESTS = 1 << 14
"""Trace rows read at once."""


class TraceArrivals:
    """The requests of ``trace``: ``max_tokens`` is each client's limit (0: its own output
    length, as a client with ``ignore_eos`` would), the trace's length where it would stop."""

    __slots__ = ("_block_size", "_max_tokens", "_routing", "trace")

    def __init__(self, trace: Trace, routing: RoutingConfig, block_size_tokens: int,
                 max_tokens: int) -> None:
        self.trace = trace
        self._routing = routing
        self._block_size = block_size_tokens
        self._max_tokens = max_tokens

    @property
    def num_requests(self) -> int:
        return self.trace.num_requests

    @property
    def last_arrival_s(self) -> float:
        """When the last request arrives (0 for an empty trace)."""
        return float(self.trace.arrival_s[-1]) if self.trace.num_requests else 0.0

    def chunks(self) -> Iterator[tuple[int, list[float], list[int], list[int]]]:
        """``(start, arrival times, prompt lengths, output lengths)`` of consecutive rows."""
        return iter_chunks(self.trace, CHUNK_REQUESTS)

    def request(self, i: int, arrival_s: float, prompt_tokens: int,
                output_tokens: int) -> SimRequest:
        """Trace row ``i`` as a request in flight."""
        max_tokens = self._max_tokens
        if max_tokens:  # the client's limit; the trace's length is where it would stop
            output_tokens = min(output_tokens, max_tokens)
        route_request = RouteRequest(prompt_tokens, max_tokens or output_tokens)
        return SimRequest(i, arrival_s, prompt_tokens, output_tokens, route_request,
                          num_blocks_to_reserve(route_request, self._block_size, self._routing))
