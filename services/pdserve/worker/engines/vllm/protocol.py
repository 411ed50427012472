"""Values shared by the agent, the scheduler side and the worker side of pdserve's connector.

How a ticket enters vLLM: the agent puts ``TicketParams.to_kv_transfer_params()`` into the
request's ``SamplingParams.extra_args["kv_transfer_params"]``; vLLM hands the dict to the
connector in ``Request.kv_transfer_params`` (EngineCore process). The scheduler side turns it
into ``LoadSpec``/``SendSpec`` entries of ``PdserveConnectorMetadata``, which vLLM pickles to the
worker process every step. Nothing else crosses between the processes, except the events the
worker side sends to the agent (``events``).

``ConnectorSettings`` is parsed once from ``KVTransferConfig.kv_connector_extra_config`` (the
same dict reaches both processes) and fails at start-up with the offending key named.
"""

from __future__ import annotations

import base64
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvLayout
from pdserve.worker.transports.values import KvDestinationSpec

PARAMS_KEY = "pdserve"
"""Key of pdserve's entry inside vLLM's ``kv_transfer_params``."""

DESTINATION_METADATA_KIND = "pdserve.vllm/1"


class TicketRole(enum.StrEnum):
    """Which side of a handoff a request is on this engine."""

    PREFILL = "prefill"  # compute the prompt, push its KV, generate nothing (max_tokens 1)
    DECODE = "decode"  # receive the prompt's KV, then decode


@dataclass(frozen=True, slots=True)
class TicketParams:
    """A ticket as a request carries it into vLLM.

    ``timeout_s`` bounds the whole handoff on this side (the ticket's lease duration as the
    coordinator handed it: a duration, never a deadline, so no clocks are compared). The decode
    side fails the load after it; the prefill side gives up waiting for the destination or the
    receiver's answer. ``destination`` (prefill side) skips the rendezvous when the agent already
    knows where the KV goes (the router's fast path).
    """

    role: TicketRole
    token: FencingToken
    timeout_s: float
    destination: KvDestinationSpec | None = None

    def __post_init__(self) -> None:
        if not self.token.ticket_id:
            raise InvalidArgumentError("ticket id is empty", field="kv_transfer_params.ticket_id")
        if self.token.attempt < 1:
            raise InvalidArgumentError("attempt must be >= 1",
                                       field="kv_transfer_params.attempt")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise InvalidArgumentError(f"timeout_s must be positive, got {self.timeout_s}",
                                       field="kv_transfer_params.timeout_s")
        if self.destination is not None and self.role is not TicketRole.PREFILL:
            raise InvalidArgumentError("only a prefill request carries a destination",
                                       field="kv_transfer_params.destination")

    def to_kv_transfer_params(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "role": self.role.value,
            "ticket_id": self.token.ticket_id,
            "attempt": self.token.attempt,
            "timeout_s": self.timeout_s,
        }
        if self.destination is not None:
            raw = self.destination.to_proto().SerializeToString()
            entry["destination"] = base64.b64encode(raw).decode("ascii")
        return {PARAMS_KEY: entry}

    @staticmethod
    def from_kv_transfer_params(params: dict[str, Any] | None) -> TicketParams | None:
        """None for a request without a pdserve ticket; ``InvalidArgumentError`` if malformed."""
        if not params or PARAMS_KEY not in params:
            return None
        entry = params[PARAMS_KEY]
        if not isinstance(entry, dict):
            raise InvalidArgumentError("kv_transfer_params.pdserve must be an object",
                                       field="kv_transfer_params")
        try:
            role = TicketRole(entry["role"])
            token = FencingToken(str(entry["ticket_id"]), int(entry["attempt"]))
            timeout_s = float(entry["timeout_s"])
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"kv_transfer_params.pdserve: bad or missing {exc}",
                                       field="kv_transfer_params") from None
        destination = None
        if entry.get("destination"):
            from pdserve.api.v1 import common_pb2

            message = common_pb2.KvDestination()
            message.ParseFromString(base64.b64decode(entry["destination"]))
            destination = KvDestinationSpec.from_proto(message)
        return TicketParams(role, token, timeout_s, destination)


@dataclass(frozen=True, slots=True)
class DestinationPlacement:
    """Where in the sequence a destination starts: rides in ``KvDestination.transport_metadata``.

    The decode side may already hold the first ``first_block`` blocks of the prompt in its
    prefix cache (shared blocks no ticket may own), so its destination lists only logical
    blocks ``first_block ..``; the sender must skip as many of its own.
    """

    first_block: int
    num_prompt_tokens: int

    def encode(self) -> bytes:
        return json.dumps({"kind": DESTINATION_METADATA_KIND, "first_block": self.first_block,
                           "num_prompt_tokens": self.num_prompt_tokens}).encode()

    @staticmethod
    def decode(raw: bytes) -> DestinationPlacement:
        try:
            entry = json.loads(raw.decode())
            if entry.get("kind") != DESTINATION_METADATA_KIND:
                raise ValueError(f"kind {entry.get('kind')!r}")
            placement = DestinationPlacement(int(entry["first_block"]),
                                             int(entry["num_prompt_tokens"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"destination metadata is not pdserve.vllm's: {exc}",
                                       field="destination.transport_metadata") from None
        if placement.first_block < 0 or placement.num_prompt_tokens <= 0:
            raise InvalidArgumentError(f"destination placement {placement} out of range",
                                       field="destination.transport_metadata")
        return placement


CONNECTOR_TRANSPORTS = ("tcp", "nixl")
"""Transports the connector drives (``inproc`` moves KV inside one process: not between engines)."""


class RendezvousKind(enum.StrEnum):
    AGENT = "agent"  # through the agent beside the engine: its events socket, its gRPC
    GRPC = "grpc"  # the coordinator's PublishDestination / AwaitDestination, from vLLM's processes
    DIRECTORY = "directory"  # a folder both workers see (one machine; tests)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of pdserve's connector (keys are the field names)."""

    rendezvous: RendezvousKind = RendezvousKind.GRPC
    coordinator_address: str = ""
    """host:port of the KV-transfer coordinator (rendezvous ``grpc``)."""
    rendezvous_dir: str = ""
    """Folder of rendezvous ``directory``."""
    kv_host: str = "127.0.0.1"
    """Where the decode side's KV receiver listens (and what it publishes)."""
    kv_port: int = 0
    events_path: str = ""
    """Unix datagram socket of the agent's event listener; empty = events only logged."""
    worker_id: str = ""
    """This worker's id, published as ``decode_worker_id``."""
    min_load_tokens: int = 1
    """Prompt tokens beyond the local prefix hit below which decode computes them itself."""
    rpc_timeout_s: float = 5.0
    transport: str = "tcp"
    """How KV moves: ``tcp`` (the prefill side pushes) or ``nixl`` (the decode side READs)."""
    die_with_parent: bool = True
    """EngineCore and its worker get SIGKILL when their parent dies (Linux PR_SET_PDEATHSIG)."""

    def __post_init__(self) -> None:
        if self.rendezvous is RendezvousKind.GRPC and not self.coordinator_address:
            raise InvalidArgumentError("rendezvous grpc needs coordinator_address",
                                       field="kv_connector_extra_config.coordinator_address")
        if self.rendezvous is RendezvousKind.AGENT and not self.events_path:
            raise InvalidArgumentError("rendezvous agent needs events_path",
                                       field="kv_connector_extra_config.events_path")
        if self.rendezvous is RendezvousKind.DIRECTORY and not self.rendezvous_dir:
            raise InvalidArgumentError("rendezvous directory needs rendezvous_dir",
                                       field="kv_connector_extra_config.rendezvous_dir")
        if not 0 <= self.kv_port <= 65535:
            raise InvalidArgumentError(f"kv_port {self.kv_port} out of range",
                                       field="kv_connector_extra_config.kv_port")
        if self.transport not in CONNECTOR_TRANSPORTS:
            raise InvalidArgumentError(
                f"transport {self.transport!r}; the connector speaks "
                f"{', '.join(CONNECTOR_TRANSPORTS)}", field="kv_connector_extra_config.transport")
        if self.min_load_tokens < 1:
            raise InvalidArgumentError("min_load_tokens must be >= 1",
                                       field="kv_connector_extra_config.min_load_tokens")

    @staticmethod
    def from_extra_config(extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = set(ConnectorSettings.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown keys {unknown}; known: {sorted(known)}",
                                       field="kv_connector_extra_config")
        try:
            if "rendezvous" in extra:
                extra["rendezvous"] = RendezvousKind(extra["rendezvous"])
            for name in ("kv_port", "min_load_tokens"):
                if name in extra:
                    extra[name] = int(extra[name])
            if "rpc_timeout_s" in extra:
                extra["rpc_timeout_s"] = float(extra["rpc_timeout_s"])
            if "die_with_parent" in extra:
                extra["die_with_parent"] = bool(extra["die_with_parent"])
        except ValueError as exc:
            raise InvalidArgumentError(f"kv_connector_extra_config: {exc}",
                                       field="kv_connector_extra_config") from None
        return ConnectorSettings(**extra)

    def to_extra_config(self) -> dict[str, Any]:
        return {name: (value.value if isinstance(value, enum.Enum) else value)
                for name, value in ((n, getattr(self, n)) for n in self.__dataclass_fields__)}


# ---- per-step metadata, scheduler side -> worker side (pickled by vLLM) ------------------------


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Decode side: receive ``dst_block_ids`` (logical blocks ``first_block ..`` of the prompt).

    vLLM allocated those blocks for this request and will not touch them until the worker
    reports the request finished receiving.
    """

    req_id: str
    token: FencingToken
    dst_block_ids: tuple[int, ...]
    first_block: int
    num_prompt_tokens: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SendSpec:
    """Prefill side, one step of one request: after this step's forward, logical blocks
    ``0 .. num_ready_blocks - 1`` of the prompt hold their final KV in ``block_ids``.

    ``is_last`` = this step computes the end of the prompt (the send may finish after it).
    """

    req_id: str
    token: FencingToken
    block_ids: tuple[int, ...]
    num_ready_blocks: int
    num_prompt_tokens: int
    is_last: bool
    timeout_s: float
    destination: KvDestinationSpec | None = None


@dataclass(slots=True)
class PdserveConnectorMetadataFields:
    """The fields, kept apart so that this module does not import vLLM (the metadata class
    itself must subclass vLLM's ``KVConnectorMetadata``: ``connector.PdserveConnectorMetadata``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    aborted_send_req_ids: list[str] = field(default_factory=list)
    """Prefill requests aborted while their KV may still be moving: stop pushing."""


def layout_of(num_layers: int, num_blocks: int, block_size_tokens: int,
              block_nbytes: int) -> KvLayout:
    return KvLayout(num_layers=num_layers, num_blocks=num_blocks,
                    block_size_tokens=block_size_tokens, block_nbytes=block_nbytes)
