"""``nixl``: one-sided KV transfer with NIXL (UCX): the decode side PULLS every layer.

Roles and rendezvous:

- The receiver (decode) owns a NIXL agent with its KV layer buffers registered and listens on a
  small TCP *control* socket (``kv_address``). Nothing else about it leaves the process: its
  ``metadata()`` is empty on purpose. The sender never learns the receiver's memory keys, so it
  cannot WRITE into decode memory at all; only the receiver initiates transfers (READs), into
  blocks it picked, after its own checks. That is the pull model's safety property, built in.
- The sender (prefill) owns one NIXL agent per KV cache (shared by all its tickets) with its
  layer buffers registered. ``open`` connects to the control socket and sends HELLO: the ticket,
  its destination blocks, the KV shape, its agent name, NIXL metadata and the base address of each
  layer buffer. ``offer_layer`` sends LAYER: ``(layer, dst block ids, src block ids)`` — an
  announcement, no KV. ``finish`` sends DONE and waits for the ACK that says every layer is in.
- The receiver runs ``ReceiverTickets.admit_layer`` on each LAYER (fencing token owns the blocks,
  ticket expected and live, layer not yet received) and only then posts one NIXL READ from the
  sender's blocks into its own; consecutive ids on both sides become one descriptor. READs of
  later layers are posted without waiting for earlier ones; a poller drives them and marks each
  layer landed as its READ completes; DONE is answered once the ticket's READs have ended. NIXL
  itself refuses a READ outside the memory the sender registered.
- A sender's agent metadata is loaded once per agent name and kept (a few hundred bytes; a
  restarted prefill worker is a new agent). The control socket is plain TCP without TLS: run
  ``nixl`` on a trusted fabric (``kv_tls`` applies to ``tcp`` only).

Control messages are versioned and length-prefixed (``_HEADER``, little-endian)::

    magic b"PDNX" | version u8 | kind u8 | flags u16 (0) | ticket uuid 16 B | attempt u32 |
    body_nbytes u32                                                          (32 bytes)

Bodies: HELLO ``<IIQQIIH`` (num_layers, block_size_tokens, block_nbytes, src_num_blocks,
num_dst_blocks, metadata_nbytes, name_nbytes) + dst ids u64[] + layer base addresses u64[] +
agent name + metadata; LAYER ``<II`` (layer, n) + dst ids u64[n] + src ids u64[n]; DONE ``<qdI``;
ABORT reason (UTF-8); ACK answered kind (u8); ERROR refused kind (u8) + reason NUL detail.

Progress: the agents run without NIXL's progress thread (it spins a core); each side drives
progress itself. The receiver polls its READs until they end (spinning briefly, then every
``read_poll_interval_s``); the sender polls its agent every ``sender_progress_interval_s`` while
it has a ticket open (UCX needs the target's progress to set up a connection, and on transports
without one-sided support, for every transfer). ``transfer`` may complete inline.

Cancellation: ``cancel`` returns only once no READ of that ticket is in flight: it drives each
for up to ``quiesce_spin_s``, then has NIXL cancel it (bounded by ``quiesce_timeout_s`` if NIXL
cannot), so the agent may free and reassign the blocks right after. Until then the blocks still
belong to the cancelled ticket, so a READ cut short can only have written into blocks of its own
ticket, which is failed and never decoded.

Environment: ``UCX_MODULES`` defaults to ``^ib`` when unset (without InfiniBand devices UCX's ib
module makes processes crash at exit); set it explicitly to use RDMA on a GPU node. Install NIXL
without its dependencies (``pip install --no-deps nixl-cu12``; the plain install pulls CUDA torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib
import itertools
import logging
import os
import struct
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from pdserve.common.errors import IllegalTransitionError, UnavailableError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.base import (
    FrameRefusedError,
    KvDestinationSpec,
    KvReceiver,
    KvSender,
    LayerAdmission,
    MonotonicClock,
    RejectReason,
    TransferPoll,
    TransferResult,
)
from pdserve.worker.transports.tcp import format_address, parse_address

logger = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Import names of the NIXL Python API, tried in this order."""
INSTALL_HINT = "pip install --no-deps nixl-cu12"

MAGIC = b"PDNX"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBH16sII")
HEADER_NBYTES = _HEADER.size
_HELLO = struct.Struct("<IIQQIIH")
_LAYER = struct.Struct("<II")
_DONE = struct.Struct("<qdI")
_MAX_TEXT_NBYTES = 4096
_MAX_METADATA_NBYTES = 16 * 1024 * 1024
_MAX_NAME_NBYTES = 1024


class Kind(enum.IntEnum):
    """Control message kinds (one byte on the wire)."""

    HELLO = 1
    LAYER = 2
    DONE = 3
    ABORT = 4
    ACK = 5
    ERROR = 6


class ControlError(ValueError):
    """Bytes on the control socket that are not a well-formed message; the connection ends."""


@dataclass(frozen=True, slots=True)
class NixlTransportSettings:
    """Knobs of the ``nixl`` backend; seconds."""

    connect_timeout_s: float = 5.0
    reply_timeout_s: float = 30.0
    sender_progress_interval_s: float = 0.001
    read_spin_polls: int = 256
    """Polls of a READ that yield to the loop without sleeping, before backing off."""
    read_poll_interval_s: float = 0.0005
    quiesce_spin_s: float = 0.05
    """``cancel`` drives a READ in flight this long before asking NIXL to cancel it."""
    quiesce_timeout_s: float = 10.0
    """Longest ``cancel`` waits for a READ in flight that NIXL cannot cancel."""


# ---- loading NIXL --------------------------------------------------------------------------


_nixl: ModuleType | None = None
_nixl_error = ""


def load_nixl() -> tuple[ModuleType | None, str]:
    """The NIXL module, or ``(None, why)``. Imported once; sets ``UCX_MODULES`` first if unset."""
    global _nixl, _nixl_error
    if _nixl is not None or _nixl_error:
        return _nixl, _nixl_error
    os.environ.setdefault("UCX_MODULES", "^ib")
    errors = []
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not hasattr(module, "nixl_agent"):
            errors.append(f"{name}: no nixl_agent")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO goes to stdout
        _nixl = module
        return _nixl, ""
    _nixl_error = f"NIXL is not installed ({INSTALL_HINT}): " + "; ".join(errors)
    return None, _nixl_error


_agent_numbers = itertools.count(1)


class _Agent:
    """A NIXL agent (UCX, no progress thread) with one KV cache's layer buffers registered.

    ``base_addresses[l]`` is the address of layer l's buffer; block b of layer l starts at
    ``base_addresses[l] + b * block_nbytes``. ``close`` deregisters (also run at collection).
    """

    def __init__(self, kv_cache: KvCache, role: str) -> None:
        nixl, why = load_nixl()
        if nixl is None:
            raise UnavailableError(f"transport 'nixl' unavailable: {why}")
        self.name = f"pdserve-{role}-{os.getpid()}-{next(_agent_numbers)}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        try:
            self.agent: Any = nixl.nixl_agent(self.name, config)
        except Exception as exc:
            raise UnavailableError(f"cannot create a NIXL agent: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise UnavailableError("NIXL has no UCX backend here")
        self.block_nbytes = kv_cache.layout.block_nbytes
        buffers = kv_cache.layer_buffers
        self.base_addresses = np.array([b.ctypes.data for b in buffers], dtype=np.uint64)
        regions = [(b.ctypes.data, b.nbytes, 0, "") for b in buffers]
        self._registration = self.agent.register_memory(regions, "DRAM")
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._remote_names: set[str] = set()
        self._finalizer = weakref.finalize(self, _deregister, self.agent, self._registration,
                                           buffers)

    def add_remote(self, name: str, metadata: bytes) -> None:
        """Load a peer's metadata once per peer name; raises ``ControlError`` if it is not
        that peer's."""
        if name in self._remote_names:
            return
        try:
            loaded = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise ControlError(f"peer metadata refused by NIXL: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(loaded)
            raise ControlError(f"metadata names agent {loaded!r}, HELLO said {name!r}")
        self._remote_names.add(name)

    def progress(self) -> None:
        """Drive the agent's progress (notifications are not used; they are dropped)."""
        self.agent.get_new_notifs()

    def close(self) -> None:
        self._finalizer()


def _deregister(agent: Any, registration: Any, buffers: list[np.ndarray]) -> None:
    """Deregister before the buffers can go away (``buffers`` is held until then)."""
    with contextlib.suppress(Exception):
        agent.deregister_memory(registration)
    del buffers


def _paired_runs(dst_ids: np.ndarray, src_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """Maximal runs where both dst and src ids go up by one: ``(dst_first, src_first, count)``."""
    is_break = (np.diff(dst_ids) != 1) | (np.diff(src_ids) != 1)
    starts = np.concatenate(([0], np.flatnonzero(is_break) + 1))
    counts = np.diff(np.concatenate((starts, [dst_ids.size])))
    return dst_ids[starts], src_ids[starts], counts


def read_descriptors(local: _Agent, layer: int, dst_ids: np.ndarray, remote_base: int,
                     src_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two ``uint64[n, 3]`` arrays ``(address, nbytes, device)``: local destination runs and the
    matching remote source runs of one layer (equal lengths row by row)."""
    block_nbytes = local.block_nbytes
    dst_first, src_first, counts = _paired_runs(dst_ids, src_ids)
    nbytes = counts.astype(np.uint64) * np.uint64(block_nbytes)
    zeros = np.zeros_like(nbytes)
    local_addr = local.base_addresses[layer] + dst_first.astype(np.uint64) * np.uint64(block_nbytes)
    remote_addr = np.uint64(remote_base) + src_first.astype(np.uint64) * np.uint64(block_nbytes)
    return (np.stack([local_addr, nbytes, zeros], axis=1),
            np.stack([remote_addr, nbytes, zeros], axis=1))


# ---- wire ------------------------------------------------------------------------------------


def encode_message(kind: int, token: FencingToken | None, body: bytes = b"") -> bytes:
    ticket = uuid.UUID(token.ticket_id).bytes if token is not None else bytes(16)
    attempt = token.attempt if token is not None else 0
    return _HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, ticket, attempt, len(body)) + body


def decode_header(data: bytes, max_body_nbytes: int) -> tuple[Kind, FencingToken | None, int]:
    """``(kind, token, body_nbytes)``; raises ``ControlError`` on anything off."""
    magic, version, kind, flags, ticket, attempt, body_nbytes = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ControlError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise ControlError(f"unsupported control format version {version}")
    if kind not in Kind.__members__.values():
        raise ControlError(f"unknown message kind {kind}")
    kind = Kind(kind)
    if flags:
        raise ControlError(f"unknown flags {flags:#x}")
    if body_nbytes > max_body_nbytes:
        raise ControlError(f"{Kind(kind).name} body of {body_nbytes} bytes > {max_body_nbytes}")
    if ticket == bytes(16) and attempt == 0:
        if kind not in (Kind.ACK, Kind.ERROR):
            raise ControlError(f"{Kind(kind).name} without a ticket")
        return kind, None, body_nbytes
    if attempt == 0:
        raise ControlError("attempt 0")
    return kind, FencingToken(str(uuid.UUID(bytes=ticket)), attempt), body_nbytes


@dataclass(frozen=True, slots=True)
class Hello:
    num_layers: int
    block_size_tokens: int
    block_nbytes: int
    src_num_blocks: int
    dst_block_ids: np.ndarray
    base_addresses: np.ndarray
    agent_name: str
    metadata: bytes

    def encode(self) -> bytes:
        name = self.agent_name.encode()
        head = _HELLO.pack(self.num_layers, self.block_size_tokens, self.block_nbytes,
                           self.src_num_blocks, self.dst_block_ids.size, len(self.metadata),
                           len(name))
        return (head + self.dst_block_ids.astype("<u8").tobytes()
                + self.base_addresses.astype("<u8").tobytes() + name + self.metadata)

    @staticmethod
    def decode(body: bytes, max_blocks: int, max_layers: int) -> Hello:
        if len(body) < _HELLO.size:
            raise ControlError("HELLO too short")
        (num_layers, block_size_tokens, block_nbytes, src_num_blocks, num_dst, md_nbytes,
         name_nbytes) = _HELLO.unpack_from(body)
        if not 1 <= num_dst <= max_blocks or not 1 <= num_layers <= max_layers:
            raise ControlError(f"HELLO names {num_dst} blocks and {num_layers} layers")
        if md_nbytes > _MAX_METADATA_NBYTES or name_nbytes > _MAX_NAME_NBYTES:
            raise ControlError("HELLO metadata or name too long")
        expected = _HELLO.size + 8 * num_dst + 8 * num_layers + name_nbytes + md_nbytes
        if len(body) != expected:
            raise ControlError(f"HELLO is {len(body)} bytes, its counts say {expected}")
        offset = _HELLO.size
        dst = np.frombuffer(body, "<u8", num_dst, offset).astype(np.int64)
        offset += 8 * num_dst
        bases = np.frombuffer(body, "<u8", num_layers, offset).astype(np.uint64)
        offset += 8 * num_layers
        name = body[offset : offset + name_nbytes].decode("utf-8", errors="strict")
        metadata = body[offset + name_nbytes :]
        return Hello(num_layers, block_size_tokens, block_nbytes, src_num_blocks, dst, bases,
                     name, metadata)


def encode_layer(layer: int, dst_ids: np.ndarray, src_ids: np.ndarray) -> bytes:
    return (_LAYER.pack(layer, dst_ids.size) + dst_ids.astype("<u8").tobytes()
            + src_ids.astype("<u8").tobytes())


def decode_layer(body: bytes, max_blocks: int) -> tuple[int, np.ndarray, np.ndarray]:
    if len(body) < _LAYER.size:
        raise ControlError("LAYER too short")
    layer, n = _LAYER.unpack_from(body)
    if not 1 <= n <= max_blocks or len(body) != _LAYER.size + 16 * n:
        raise ControlError(f"LAYER of {len(body)} bytes names {n} blocks")
    dst = np.frombuffer(body, "<u8", n, _LAYER.size)
    src = np.frombuffer(body, "<u8", n, _LAYER.size + 8 * n)
    return layer, dst.astype(np.int64), src.astype(np.int64)


def _error_body(refused_kind: int, reason: str, detail: str) -> bytes:
    return bytes([refused_kind & 0xFF]) + f"{reason}\0{detail}".encode()[:_MAX_TEXT_NBYTES]


async def _read_message(reader: asyncio.StreamReader, max_body_nbytes: int
                        ) -> tuple[int, FencingToken | None, bytes] | None:
    """The next message, or None at a clean EOF between messages."""
    try:
        header = await reader.readexactly(HEADER_NBYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectionResetError("peer closed in the middle of a header") from None
    kind, token, body_nbytes = decode_header(header, max_body_nbytes)
    body = await reader.readexactly(body_nbytes) if body_nbytes else b""
    return kind, token, body


# ---- receiver --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a ticket's layers are read from: the sender's agent and its layer buffers."""

    agent_name: str
    base_addresses: np.ndarray
    num_blocks: int


@dataclass(eq=False)
class _Read:
    """One posted READ of one admitted layer. ``is_ended``: no byte of it moves any more
    (completed, failed, or cancelled by NIXL, ``is_cancelled``)."""

    admission: LayerAdmission
    handle: Any
    status: str = "PROC"
    is_ended: bool = False
    is_cancelled: bool = False

    @property
    def token(self) -> FencingToken:
        return self.admission.token

    def try_cancel(self) -> bool:
        try:
            self.handle.release()
        except Exception:  # noqa: BLE001 - NIXL could not cancel it (yet)
            return False
        self.is_cancelled = True
        self.is_ended = True
        self.status = "CANCELLED"
        return True


@dataclass(eq=False)
class _Connection:
    """One sender's control connection. LAYER and DONE messages wait in ``ordered`` for the
    connection's worker, which posts each layer's READ without waiting for the previous one to
    finish (``pending``, polled by one poller task) and holds DONE until the ticket's READs have
    ended; HELLO and ABORT act at once, so an ABORT stops READs that wait for a sender that has
    gone quiet."""

    writer: asyncio.StreamWriter
    sources: dict[FencingToken, _Source] = field(default_factory=dict)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ordered: asyncio.Queue[tuple[Kind, FencingToken | None, bytes]] = field(
        default_factory=asyncio.Queue)
    pending: list[_Read] = field(default_factory=list)
    read_ended: asyncio.Event = field(default_factory=asyncio.Event)
    poller: asyncio.Task[None] | None = None


class NixlKvReceiver(KvReceiver):
    """Decode side of ``nixl``: a control socket for announcements, NIXL READs for the KV."""

    def __init__(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                 clock: MonotonicClock = time.perf_counter,
                 settings: NixlTransportSettings = NixlTransportSettings()) -> None:
        super().__init__(kv_cache, owner_table, clock)
        self._settings = settings
        layout = kv_cache.layout
        self._max_body_nbytes = (_HELLO.size + 16 * layout.num_blocks + 8 * layout.num_layers
                                 + _MAX_NAME_NBYTES + _MAX_METADATA_NBYTES)
        self._agent: _Agent | None = None
        self._server: asyncio.Server | None = None
        self._address = ""
        self._connections: set[_Connection] = set()
        self._token_to_connection: dict[FencingToken, _Connection] = {}
        self._inflight: dict[int, _Read] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_reads = 0
        self.tickets.on_failed = self._on_ticket_failed

    @property
    def agent_name(self) -> str:
        return self._agent.name if self._agent is not None else ""

    async def start(self, host: str, port: int) -> str:
        if self._server is not None:
            raise IllegalTransitionError(f"receiver already started at {self._address}")
        self._agent = _Agent(self.kv_cache, "recv")
        self._server = await asyncio.start_server(self._serve, host, port)
        bound_port = self._server.sockets[0].getsockname()[1]
        self._address = format_address(host, bound_port)
        logger.info("NIXL KV receiver %s, control socket %s", self._agent.name, self._address)
        return self._address

    async def close(self) -> None:
        for token in self.tickets.active_tokens():
            self.tickets.fail(token, "receiver closed")
        for read in list(self._inflight.values()):
            self._quiesce(read.token)
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.writer.close()  # its handler sees EOF and ends
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        if self._agent is not None:
            self._agent.close()

    def cancel(self, token: FencingToken, reason: str) -> None:
        """See ``KvReceiver.cancel``; also waits for a READ of ``token`` in flight to end."""
        super().cancel(token, reason)
        self._quiesce(token)

    def _quiesce(self, token: FencingToken) -> None:
        """End ``token``'s READs in flight (if any) before returning, blocking for a layer at
        most: drive each for up to ``quiesce_spin_s``, then ask NIXL to cancel it (release);
        if NIXL cannot, keep driving it until ``quiesce_timeout_s``."""
        if self._agent is None:
            return
        agent = self._agent.agent
        started = time.monotonic()
        for read in list(self._inflight.values()):
            if read.token != token or read.is_ended:
                continue
            while not read.is_ended:
                read.status = agent.check_xfer_state(read.handle)
                read.is_ended = read.status != "PROC"
                waited_s = time.monotonic() - started
                if not read.is_ended and waited_s > self._settings.quiesce_spin_s:
                    if read.try_cancel():
                        break
                    if waited_s > self._settings.quiesce_timeout_s:
                        logger.error("READ of %s still in flight after %.1f s", token, waited_s)
                        return

    # -- connections --

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        connection = _Connection(writer)
        self._connections.add(connection)
        worker = asyncio.create_task(self._work(connection), name="nixl-reads")
        try:
            while not worker.done():
                try:
                    message = await _read_message(reader, self._max_body_nbytes)
                except ControlError as exc:
                    rejection = self.tickets.refuse(None, "?", 0, RejectReason.MALFORMED_FRAME,
                                                    str(exc))
                    await self._reply(connection, encode_message(
                        Kind.ERROR, None, _error_body(0, rejection.reason, rejection.detail)))
                    break
                if message is None:
                    break
                if message[0] in (Kind.LAYER, Kind.DONE):
                    connection.ordered.put_nowait(message)
                elif not await self._dispatch(connection, *message):
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            logger.debug("NIXL control connection lost: %s", exc)
        finally:
            self._connections.discard(connection)
            for token in connection.sources:
                if self._token_to_connection.get(token) is connection:
                    del self._token_to_connection[token]
                self.tickets.fail(token, "connection lost")
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            if connection.poller is not None:
                connection.poller.cancel()
                await asyncio.gather(connection.poller, return_exceptions=True)
            writer.close()

    async def _work(self, connection: _Connection) -> None:
        """Ordered messages of one connection. At EOF the reader cancels this: a sender that
        closed before DONE's ACK has failed (its READs may never complete)."""
        while True:
            kind, token, body = await connection.ordered.get()
            if not await self._dispatch(connection, kind, token, body):
                return

    async def _reply(self, connection: _Connection, message: bytes) -> None:
        try:
            async with connection.write_lock:
                connection.writer.write(message)
                await connection.writer.drain()
        except (ConnectionError, OSError) as exc:
            logger.debug("NIXL control reply lost: %s", exc)

    async def _refused(self, connection: _Connection, kind: int, token: FencingToken | None,
                       exc: FrameRefusedError) -> None:
        rejection = exc.rejection
        await self._reply(connection, encode_message(
            Kind.ERROR, token, _error_body(kind, rejection.reason, rejection.detail)))

    def _on_ticket_failed(self, token: FencingToken, reason: str) -> None:
        """Tell the sender at once (it can stop computing); best effort."""
        connection = self._token_to_connection.get(token)
        if connection is not None:
            body = _error_body(0, reason.partition(":")[0], reason)
            self._spawn(self._reply(connection, encode_message(Kind.ERROR, token, body)))

    async def _dispatch(self, connection: _Connection, kind: int, token: FencingToken | None,
                        body: bytes) -> bool:
        """Handle one message; False ends the connection."""
        assert token is not None or kind in (Kind.ACK, Kind.ERROR)
        try:
            if kind == Kind.HELLO:
                assert token is not None
                self._on_hello(connection, token, body)
                await self._reply(connection, encode_message(Kind.ACK, token, bytes([Kind.HELLO])))
            elif kind == Kind.LAYER:
                assert token is not None
                await self._on_layer(connection, token, body)
            elif kind == Kind.DONE:
                assert token is not None
                if len(body) != _DONE.size:
                    raise ControlError(f"DONE body is {len(body)} bytes")
                first_token_id, prefill_compute_s, num_layers = _DONE.unpack(body)
                while any(read.token == token for read in connection.pending):
                    connection.read_ended.clear()
                    await connection.read_ended.wait()
                self.tickets.admit_done(token, first_token_id, prefill_compute_s, num_layers)
                await self._reply(connection, encode_message(Kind.ACK, token, bytes([Kind.DONE])))
            elif kind == Kind.ABORT:
                assert token is not None
                reason = body[:_MAX_TEXT_NBYTES].decode("utf-8", errors="replace")
                if token in connection.sources:
                    self.tickets.fail(token, f"aborted by sender: {reason}")
                else:  # only the connection that introduced a ticket may abort it
                    self.tickets.refuse(None, "ABORT", 0, RejectReason.PROTOCOL,
                                        f"ABORT for {token} from a connection not carrying it")
            else:
                self.tickets.refuse(token, Kind(kind).name, 0, RejectReason.PROTOCOL,
                                    "senders do not send ACK or ERROR")
                return False
        except FrameRefusedError as exc:
            await self._refused(connection, kind, token, exc)
        except ControlError as exc:
            rejection = self.tickets.refuse(token if token in connection.sources else None,
                                            Kind(kind).name, 0, RejectReason.MALFORMED_FRAME,
                                            str(exc))
            await self._reply(connection, encode_message(
                Kind.ERROR, token, _error_body(kind, rejection.reason, rejection.detail)))
        return True

    def _on_hello(self, connection: _Connection, token: FencingToken, body: bytes) -> None:
        layout = self.kv_cache.layout
        try:
            hello = Hello.decode(body, layout.num_blocks, layout.num_layers)
        except (ControlError, UnicodeDecodeError) as exc:
            raise FrameRefusedError(self.tickets.refuse(
                None, "HELLO", 0, RejectReason.MALFORMED_FRAME, str(exc))) from None
        self.tickets.admit_hello(token, hello.dst_block_ids, hello.num_layers,
                                 hello.block_size_tokens, hello.block_nbytes)
        assert self._agent is not None
        try:
            self._agent.add_remote(hello.agent_name, hello.metadata)
        except ControlError as exc:
            raise FrameRefusedError(self.tickets.refuse(
                token, "HELLO", 0, RejectReason.PROTOCOL, str(exc))) from None
        connection.sources[token] = _Source(hello.agent_name, hello.base_addresses,
                                            hello.src_num_blocks)
        self._token_to_connection[token] = connection

    async def _on_layer(self, connection: _Connection, token: FencingToken, body: bytes) -> None:
        layer, dst_ids, src_ids = decode_layer(body, self.kv_cache.layout.num_blocks)
        source = connection.sources.get(token)
        if source is None:  # not this connection's ticket: record, fail nothing
            raise FrameRefusedError(self.tickets.refuse(
                None, "LAYER", layer, RejectReason.PROTOCOL,
                f"LAYER for {token} before its HELLO on this connection"))
        if np.unique(dst_ids).size != dst_ids.size or int(src_ids.max()) >= source.num_blocks:
            raise FrameRefusedError(self.tickets.refuse(
                token, "LAYER", layer, RejectReason.MALFORMED_FRAME,
                "destination ids repeat or source ids exceed the sender's cache"))
        admission = self.tickets.admit_layer(token, layer, dst_ids)
        if layer >= source.base_addresses.size:
            raise FrameRefusedError(self.tickets.refuse(
                token, "LAYER", layer, RejectReason.LAYER_OUT_OF_RANGE, "sender has no such layer"))
        self._post_read(connection, admission, source, src_ids)

    def _post_read(self, connection: _Connection, admission: LayerAdmission, source: _Source,
                   src_ids: np.ndarray) -> None:
        """Post the READ of one admitted layer into its blocks; the poller finishes it."""
        assert self._agent is not None
        agent = self._agent.agent
        if not admission.still_writable():
            return
        local, remote = read_descriptors(self._agent, admission.layer, admission.block_ids,
                                         int(source.base_addresses[admission.layer]), src_ids)
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"),
                                           source.agent_name)
        except Exception as exc:  # noqa: BLE001 - NIXL refuses unregistered source ranges here
            raise FrameRefusedError(self.tickets.refuse(
                admission.token, "LAYER", admission.layer, RejectReason.MALFORMED_FRAME,
                f"NIXL refused the READ: {type(exc).__name__} {exc}")) from None
        read = _Read(admission, handle)
        self._inflight[id(read)] = read
        connection.pending.append(read)
        read.status = agent.transfer(handle)
        read.is_ended = read.status != "PROC"
        if read.is_ended:
            self._end_read(connection, read)
        elif connection.poller is None or connection.poller.done():
            connection.poller = asyncio.create_task(self._poll_reads(connection),
                                                    name="nixl-read-poller")

    async def _poll_reads(self, connection: _Connection) -> None:
        """Drive the connection's READs until none is pending (spin, then back off)."""
        assert self._agent is not None
        agent = self._agent.agent
        polls = 0
        try:
            while connection.pending:
                for read in list(connection.pending):
                    if not read.is_ended and read.admission.ticket.state.is_terminal:
                        self._quiesce(read.token)  # failed or cancelled: end it now
                    if not read.is_ended:
                        read.status = agent.check_xfer_state(read.handle)
                        read.is_ended = read.status != "PROC"
                    if read.is_ended:
                        self._end_read(connection, read)
                if connection.pending:
                    polls += 1
                    await asyncio.sleep(0 if polls < self._settings.read_spin_polls
                                        else self._settings.read_poll_interval_s)
        finally:  # cancelled (connection gone, receiver closing): no READ may outlive us
            for read in list(connection.pending):
                self._quiesce(read.token)
                self._end_read(connection, read)

    def _end_read(self, connection: _Connection, read: _Read) -> None:
        """An ended READ: land it if it completed and the ticket still owns the blocks."""
        connection.pending.remove(read)
        self._inflight.pop(id(read), None)
        connection.read_ended.set()
        if not read.is_cancelled:
            with contextlib.suppress(Exception):
                read.handle.release()
        self.num_reads += 1
        admission = read.admission
        if read.status != "DONE" or not read.is_ended:
            self.tickets.fail(read.token,
                              f"NIXL READ of layer {admission.layer} failed ({read.status})")
        elif admission.still_writable():
            num_bytes = admission.block_ids.size * self.kv_cache.layout.block_nbytes
            self.tickets.layer_landed(admission, num_bytes)


# ---- sender ----------------------------------------------------------------------------------


class _SenderAgent:
    """The prefill side's agent for one KV cache, shared by its senders, and the task that
    drives its progress while any of them is open."""

    def __init__(self, kv_cache: KvCache, settings: NixlTransportSettings) -> None:
        self.local = _Agent(kv_cache, "send")
        self._settings = settings
        self._num_open = 0
        self._task: asyncio.Task[None] | None = None

    def acquire(self) -> None:
        self._num_open += 1
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._progress_loop(), name="nixl-progress")

    def release(self) -> None:
        self._num_open -= 1
        if self._num_open == 0 and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _progress_loop(self) -> None:
        while True:
            self.local.progress()
            await asyncio.sleep(self._settings.sender_progress_interval_s)


class NixlKvSender(KvSender):
    """Prefill side of ``nixl``: announces layers; the receiver READs them."""

    def __init__(self, kv_cache: KvCache, shared: _SenderAgent,
                 clock: MonotonicClock = time.perf_counter,
                 settings: NixlTransportSettings = NixlTransportSettings()) -> None:
        super().__init__(kv_cache, clock)
        self._shared = shared
        self._settings = settings
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reply_task: asyncio.Task[None] | None = None
        self._hello_reply: asyncio.Future[str | None] | None = None
        self._done_reply: asyncio.Future[str | None] | None = None
        self._dst_ids: np.ndarray | None = None
        self._is_acquired = False

    async def open(self, dest: KvDestinationSpec, token: FencingToken) -> None:
        self._check_open(dest, token)
        host, port = parse_address(dest.kv_address)
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), self._settings.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            self._fail(f"cannot connect to {dest.kv_address}: {exc or 'timeout'}")
            self._raise_failed()
        self._shared.acquire()
        self._is_acquired = True
        loop = asyncio.get_running_loop()
        self._hello_reply, self._done_reply = loop.create_future(), loop.create_future()
        self._reply_task = asyncio.create_task(self._read_replies(), name=f"nixl-replies-{token}")
        self._dst_ids = np.asarray(dest.block_ids, dtype=np.int64)
        local = self._shared.local
        layout = self.kv_cache.layout
        hello = Hello(layout.num_layers, layout.block_size_tokens, layout.block_nbytes,
                      layout.num_blocks, self._dst_ids, local.base_addresses, local.name,
                      local.metadata)
        await self._send(encode_message(Kind.HELLO, token, hello.encode()))
        await self._await_reply(self._hello_reply)

    async def offer_layer(
        self, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None
    ) -> None:
        offer = self._make_offer(layer, src_block_ids, dst_block_ids)
        dst = (self._dst_ids if dst_block_ids is None
               else np.asarray(offer.dst_block_ids, dtype=np.int64))
        assert dst is not None
        src = np.asarray(offer.src_block_ids, dtype=np.int64)
        await self._send(encode_message(Kind.LAYER, self._token, encode_layer(layer, dst, src)))
        self._offered(offer)

    async def finish(self, first_token_id: int, prefill_compute_s: float) -> TransferResult:
        if self._state.is_terminal or self._done_reply is None:
            self._raise_failed()
        body = _DONE.pack(first_token_id, prefill_compute_s, len(self._offered_layers))
        await self._send(encode_message(Kind.DONE, self._token, body))
        assert self._done_reply is not None
        await self._await_reply(self._done_reply)
        return self._succeeded(first_token_id, prefill_compute_s)

    async def abort(self, reason: str) -> None:
        if not self._state.is_terminal and self._writer is not None:
            message = encode_message(Kind.ABORT, self._token,
                                     reason.encode()[:_MAX_TEXT_NBYTES])
            with contextlib.suppress(OSError, TimeoutError):
                self._writer.write(message)
                await asyncio.wait_for(self._writer.drain(), self._settings.connect_timeout_s)
        self._fail(f"aborted: {reason}")
        await self.close()

    async def close(self) -> None:
        self._fail("closed before finish")
        if self._reply_task is not None:
            self._reply_task.cancel()
            await asyncio.gather(self._reply_task, return_exceptions=True)
            self._reply_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._is_acquired:
            self._is_acquired = False
            self._shared.release()

    async def _send(self, message: bytes) -> None:
        if self._writer is None:
            self._raise_failed()
        assert self._writer is not None
        try:
            self._writer.write(message)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self._fail(f"connection lost: {exc}")
            self._raise_failed()

    async def _await_reply(self, reply: asyncio.Future[str | None]) -> None:
        try:
            error = await asyncio.wait_for(asyncio.shield(reply), self._settings.reply_timeout_s)
        except TimeoutError:
            self._fail(f"no reply from the receiver within {self._settings.reply_timeout_s} s")
            self._raise_failed()
        if error is not None:
            self._fail(error)
            self._raise_failed()

    @staticmethod
    def _resolve(reply: asyncio.Future[str | None] | None, error: str | None) -> None:
        if reply is not None and not reply.done():
            reply.set_result(error)

    async def _read_replies(self) -> None:
        assert self._reader is not None
        error = "connection closed by the receiver"
        try:
            while True:
                message = await _read_message(self._reader, 2 * _MAX_TEXT_NBYTES)
                if message is None:
                    break
                kind, token, body = message
                if kind not in (Kind.ACK, Kind.ERROR):
                    error = f"receiver sent a {Kind(kind).name} message"
                    break
                if token is not None and token != self._token:
                    continue
                if kind == Kind.ACK:
                    answered = body[0] if body else 0
                    if answered == Kind.HELLO:
                        self._resolve(self._hello_reply, None)
                    elif answered == Kind.DONE:
                        self._resolve(self._done_reply, None)
                    continue
                reason, _, detail = body[1:].decode("utf-8", errors="replace").partition("\0")
                error = f"refused: {detail or reason}"
                self._fail(error)
                break
        except (ControlError, ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            error = f"connection lost: {exc}"
        is_done = self._done_reply is not None and self._done_reply.done()
        if not (is_done and self._done_reply.result() is None):  # type: ignore[union-attr]
            self._fail(error)
        self._resolve(self._hello_reply, error)
        self._resolve(self._done_reply, error)


# ---- backend ---------------------------------------------------------------------------------


class NixlBackend:
    """The ``nixl`` backend: available where the NIXL Python API imports."""

    name = "nixl"
    is_pull = True

    def __init__(self, settings: NixlTransportSettings = NixlTransportSettings()) -> None:
        self.settings = settings
        self._sender_agents: weakref.WeakKeyDictionary[KvCache, _SenderAgent] = (
            weakref.WeakKeyDictionary())

    def is_available(self) -> tuple[bool, str]:
        nixl, why = load_nixl()
        return nixl is not None, why

    def create_receiver(self, kv_cache: KvCache, owner_table: BlockOwnerTable,
                        *, clock: MonotonicClock = time.perf_counter) -> NixlKvReceiver:
        return NixlKvReceiver(kv_cache, owner_table, clock, self.settings)

    def create_sender(self, kv_cache: KvCache,
                      *, clock: MonotonicClock = time.perf_counter) -> NixlKvSender:
        shared = self._sender_agents.get(kv_cache)
        if shared is None:
            shared = _SenderAgent(kv_cache, self.settings)
            self._sender_agents[kv_cache] = shared
        return NixlKvSender(kv_cache, shared, clock, self.settings)


BACKEND = NixlBackend()

__all__ = [
    "BACKEND",
    "NixlBackend",
    "NixlKvReceiver",
    "NixlKvSender",
    "NixlTransportSettings",
    "TransferPoll",
    "load_nixl",
]
