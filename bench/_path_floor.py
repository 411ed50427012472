"""The floor of pdserve's process topology, for ``bench/peers.py`` (its ``floor`` system).

Four Python processes in pdserve's deployment shape, each doing only the transport work one
disaggregated request needs on its hop, and nothing pdserve adds to keep its guarantees (no
leases, fencing checks, admission, retries, audit, metrics or logging):

- ``router``: aiohttp's OpenAI ``/v1/completions`` (streamed or whole); per request one Redis
  read (the prefix index), ``Open`` at the coordinator, a ``Decode`` server stream whose first
  message is the KV destination, then ``Prefill`` with it;
- ``coordinator``: ``Open`` runs one Lua script (the ticket and the ledger reservation);
  ``Report`` runs one per ticket it carries (the release);
- ``prefill``: ``Prefill`` sends the prompt's KV, one frame per layer, over a long-lived TCP
  connection to the decode worker, a CRC-32C over each layer, and waits for the ack;
- ``decode``: receives the frames (CRC-32C of each), acks, streams the tokens and reports the
  ended tickets to the coordinator in batches (one call in flight, the rest waiting for it).

gRPC calls use generic handlers on raw bytes (no protobuf), the same grpcio, uvloop, redis-py
and hiredis as pdserve. It answers what no amount of trimming inside pdserve's own code can
reach with this many Python processes and calls on the path.

    python bench/_path_floor.py ROLE --redis-url URL --ports C,P,D,K,H [--block-nbytes N]
        [--num-layers L] [--model M]

ROLE is router, coordinator, prefill or decode; the ports are the coordinator's, the prefill
worker's and the decode worker's gRPC ports, the decode worker's KV port and the router's HTTP
port. Each process prints ``ready`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import crc32c
import grpc
import redis.asyncio as aioredis
import uvloop
from aiohttp import web

_FRAME = struct.Struct("!32sII")
"""A KV frame's header: ticket id (32 hex characters), layer, payload bytes."""
_OPEN_LUA = ("redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'num_blocks', ARGV[2]) "
             "return redis.call('HINCRBY', KEYS[2], 'reserved', ARGV[2])")
_RELEASE_LUA = ("redis.call('DEL', KEYS[1]) "
                "return redis.call('HINCRBY', KEYS[2], 'reserved', -tonumber(ARGV[1]))")
_LEDGER_KEY = "floor:ledger:{decode-0}"


def _raw(data: bytes) -> bytes:
    return data


@dataclass(frozen=True, slots=True)
class FloorConfig:
    redis_url: str
    coordinator_port: int
    prefill_port: int
    decode_port: int
    decode_kv_port: int
    http_port: int
    block_nbytes: int
    """KV bytes of one block in one layer."""
    num_layers: int
    model: str
    block_size_tokens: int = 16

    def num_blocks(self, num_prompt_tokens: int) -> int:
        return -(-num_prompt_tokens // self.block_size_tokens)


def _ticket_key(ticket_id: str) -> str:
    return f"floor:ticket:{{decode-0}}:{ticket_id}"


async def _serve_grpc(port: int, service: str,
                      handlers: dict[str, grpc.RpcMethodHandler]) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def coordinator(config: FloorConfig) -> None:
    store = aioredis.Redis.from_url(config.redis_url)
    open_script = store.register_script(_OPEN_LUA)
    release_script = store.register_script(_RELEASE_LUA)

    async def open_ticket(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ticket_id, num_blocks = request.decode().split(":")
        await open_script(keys=[_ticket_key(ticket_id), _LEDGER_KEY],
                          args=["decode-0", num_blocks])
        return request

    async def report(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        for ended in request.decode().split(","):
            ticket_id, num_blocks = ended.split(":")
            await release_script(keys=[_ticket_key(ticket_id), _LEDGER_KEY], args=[num_blocks])
        return b""

    server = await _serve_grpc(config.coordinator_port, "floor.Coordinator", {
        "Open": grpc.unary_unary_rpc_method_handler(open_ticket, _raw, _raw),
        "Report": grpc.unary_unary_rpc_method_handler(report, _raw, _raw)})
    print("ready", flush=True)
    await server.wait_for_termination()


async def prefill(config: FloorConfig) -> None:
    payloads: dict[int, bytes] = {}
    acks: dict[bytes, asyncio.Future[None]] = {}
    connection: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    send_lock = asyncio.Lock()

    async def read_acks(reader: asyncio.StreamReader) -> None:
        while True:
            ticket_id = await reader.readexactly(32)
            acks.pop(ticket_id).set_result(None)

    async def do_prefill(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ticket_id = request[:32]
        num_nbytes = config.num_blocks(len(json.loads(request[32:]))) * config.block_nbytes
        payload = payloads.get(num_nbytes) or payloads.setdefault(
            num_nbytes, bytes(i % 251 for i in range(num_nbytes)))
        done = asyncio.get_running_loop().create_future()
        acks[ticket_id] = done
        async with send_lock:
            if not connection:
                connection.append(await asyncio.open_connection(
                    "127.0.0.1", config.decode_kv_port))
                asyncio.ensure_future(read_acks(connection[0][0]))
            writer = connection[0][1]
            crc = 0
            for layer in range(config.num_layers):
                crc = crc32c.crc32c(payload, crc)
                writer.write(_FRAME.pack(ticket_id, layer, len(payload)))
                writer.write(payload)
            await writer.drain()
        await done
        return b"first-token"

    server = await _serve_grpc(config.prefill_port, "floor.Prefill", {
        "Prefill": grpc.unary_unary_rpc_method_handler(do_prefill, _raw, _raw)})
    print("ready", flush=True)
    await server.wait_for_termination()


@dataclass(slots=True)
class _Landing:
    num_layers: int = 0
    crc: int = 0
    waiter: asyncio.Future[None] | None = None
    is_done: bool = False


async def decode(config: FloorConfig) -> None:
    landings: dict[bytes, _Landing] = collections.defaultdict(_Landing)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{config.coordinator_port}")
    report = channel.unary_unary("/floor.Coordinator/Report", request_serializer=_raw,
                                 response_deserializer=_raw)
    ended: list[bytes] = []
    is_reporting = False

    async def report_ended() -> None:
        nonlocal is_reporting
        try:
            while ended:
                batch = b",".join(ended)
                ended.clear()
                await report(batch)
        finally:
            is_reporting = False

    def ticket_ended(ticket_id: bytes) -> None:
        nonlocal is_reporting
        ended.append(ticket_id)
        if not is_reporting:
            is_reporting = True
            asyncio.ensure_future(report_ended())

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                header = await reader.readexactly(_FRAME.size)
            except asyncio.IncompleteReadError:
                return
            ticket_id, _, num_bytes = _FRAME.unpack(header)
            data = await reader.readexactly(num_bytes)
            landing = landings[ticket_id]
            landing.crc = crc32c.crc32c(data, landing.crc)
            landing.num_layers += 1
            if landing.num_layers == config.num_layers:
                writer.write(ticket_id)
                landing.is_done = True
                if landing.waiter is not None:
                    landing.waiter.set_result(None)

    async def do_decode(request: bytes, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[bytes]:
        ticket_id = request[:32]
        num_blocks = config.num_blocks(len(json.loads(request[32:])))
        yield b"destination:decode-0"
        landing = landings[ticket_id]
        if not landing.is_done:
            landing.waiter = asyncio.get_running_loop().create_future()
            await landing.waiter
        del landings[ticket_id]
        yield b"1"
        yield b"2,3,4,5,6,7,8"
        ticket_ended(ticket_id + b":%d" % num_blocks)

    kv_server = await asyncio.start_server(on_connection, "127.0.0.1", config.decode_kv_port)
    server = await _serve_grpc(config.decode_port, "floor.Decode", {
        "Decode": grpc.unary_stream_rpc_method_handler(do_decode, _raw, _raw)})
    print("ready", flush=True)
    async with kv_server:
        await server.wait_for_termination()


def _chunk(model: str, created: int, text: str, finish: str | None,
           usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, object] = {"id": "cmpl-floor", "object": "text_completion.chunk",
                               "created": created, "model": model,
                               "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def router(config: FloorConfig) -> None:
    store = aioredis.Redis.from_url(config.redis_url)
    coordinator_channel = grpc.aio.insecure_channel(f"127.0.0.1:{config.coordinator_port}")
    prefill_channel = grpc.aio.insecure_channel(f"127.0.0.1:{config.prefill_port}")
    decode_channel = grpc.aio.insecure_channel(f"127.0.0.1:{config.decode_port}")
    open_ticket = coordinator_channel.unary_unary(
        "/floor.Coordinator/Open", request_serializer=_raw, response_deserializer=_raw)
    prefill_call = prefill_channel.unary_unary(
        "/floor.Prefill/Prefill", request_serializer=_raw, response_deserializer=_raw)
    decode_call = decode_channel.unary_stream(
        "/floor.Decode/Decode", request_serializer=_raw, response_deserializer=_raw)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ticket_id = uuid.uuid4().hex.encode()
        await store.hmget("floor:prefix:decode-0", [str(hash(tuple(prompt[:16])))])
        await open_ticket(ticket_id + b":%d" % config.num_blocks(len(prompt)))
        stream = decode_call(ticket_id + json.dumps(prompt).encode())
        messages = stream.__aiter__()
        await anext(messages)  # the destination, once the decode side admitted the ticket
        prefilled = asyncio.ensure_future(prefill_call(ticket_id + json.dumps(prompt).encode()))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": int(body["max_tokens"]),
                 "total_tokens": len(prompt) + int(body["max_tokens"])}
        created = int(time.time())
        if not body.get("stream"):
            texts = [message.decode() async for message in messages]
            await prefilled
            return web.json_response({
                "id": "cmpl-floor", "object": "text_completion", "created": created,
                "model": config.model, "usage": usage,
                "choices": [{"index": 0, "text": ",".join(texts), "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for message in messages:
            await response.write(_chunk(config.model, created, message.decode(), None))
        await prefilled
        await response.write(_chunk(config.model, created, "", "length", usage)
                             + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": config.model, "object": "model", "owned_by": "floor"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config.http_port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


ROLES = {"router": router, "coordinator": coordinator, "prefill": prefill, "decode": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--ports", required=True,
                        help="coordinator,prefill,decode gRPC ports, decode KV port, HTTP port")
    parser.add_argument("--block-nbytes", type=int, default=1024,
                        help="KV bytes of a 16-token block in one layer (the sim engine's "
                             "llama-3.1-8b at its default 1/64 scale)")
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--model", default="llama-3.1-8b")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    if len(ports) != 5:
        parser.error("--ports: five ports")
    config = FloorConfig(args.redis_url, *ports, block_nbytes=args.block_nbytes,
                         num_layers=args.num_layers, model=args.model)
    uvloop.run(ROLES[args.role](config))


if __name__ == "__main__":
    main()
