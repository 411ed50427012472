"""Benchmark the KV transports against the raw transport under them, and the handoff's exposed
cost for the tiny model.

1. Bandwidth. KV moved the way the real path moves it: per layer, in the paged block layout of a
   Llama-3.1-8B-shaped cache (32 layers, 8 KV heads x 128 x bf16, K and V, 16-token blocks:
   64 KiB per block per layer), source and destination blocks at random, non-contiguous ids.

       1 MiB    1 block x 32 layers of the TP=2 shard (4 KV heads: 32 KiB blocks; one 16-token
                block of the full model is already 2 MiB)
       16 MiB   8 blocks (128 tokens) x 32 layers
       256 MiB  128 blocks (2,048 tokens) x 32 layers

   Each size is moved by our transport (a whole ticket: open, every layer, finish, wall time on
   the sender until the receiver's ACK that everything landed) and, in the same run, interleaved,
   by the raw transport moving the same bytes between the same blocks:
   ``tcp`` vs plain blocking sockets (a connection per ticket, ``sendall`` of each source block,
   ``recv_into`` each destination block, a one-byte ACK); ``nixl`` vs bare NIXL READs of the same
   per-layer descriptors (all layers posted at once, both sides spinning on progress, timed from
   the request to the receiver's reply). The receiver is another process. Median of ``--runs``.

2. Exposed transfer. The default tiny model (8 layers) prefills prompts of 256..4,096 tokens on
   a prefill ``WorkerAgent`` (this process) whose KV goes layer by layer to a decode
   ``WorkerAgent`` (the other process): exposed time (from the end of prefill compute to the
   receiver's ACK of the last layer) over prefill compute time.

Both tables are printed; the last stdout line is one JSON object with ``tcp_vs_raw_16MiB``,
``tcp_vs_raw_256MiB``, ``nixl_vs_raw_16MiB``, ``nixl_vs_raw_256MiB`` (null without NIXL) and
``exposed_over_prefill_max``.

    python bench/kv_transfer.py [--runs 7] [--lengths 256,512,1024,2048,4096]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: the tiny engine's setting
os.environ.setdefault("UCX_MODULES", "^ib")

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdserve.common.types import FencingToken, WorkerRole, WorkerState
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports import registry
from pdserve.worker.transports.values import KvDestinationSpec

MiB = 1024 * 1024
NUM_LAYERS = 32
BLOCK_SIZE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    block_nbytes: int
    num_ticket_blocks: int

    @property
    def num_bytes(self) -> int:
        return NUM_LAYERS * self.block_nbytes * self.num_ticket_blocks

    @property
    def layout(self) -> KvLayout:
        # Room for random placement: half again as many blocks as a ticket needs, at least 16.
        num_blocks = max(16, self.num_ticket_blocks * 3 // 2)
        return KvLayout(NUM_LAYERS, num_blocks, BLOCK_SIZE_TOKENS, self.block_nbytes)


CASES = (
    Case("1MiB", 32 * 1024, 1),
    Case("16MiB", 64 * 1024, 8),
    Case("256MiB", 64 * 1024, 128),
)


def nixl_status() -> str:
    """"" when the nixl backend is usable here, else why not."""
    return registry.backend_status().get("nixl", "not registered")


def blocks_digest(cache: KvCache, block_ids: list[int]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for buffer in cache.layer_buffers:
        digest.update(np.ascontiguousarray(buffer[block_ids]).tobytes())
    return digest.hexdigest()


# ---- the receiving process ------------------------------------------------------------------


class ReceiverRig:
    """One layout's destination cache in the receiving process, with every receiver over it."""

    def __init__(self, layout: KvLayout) -> None:
        self.cache = KvCache(layout)
        self.owners = BlockOwnerTable(layout.num_blocks)
        self.receivers: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}
        self.raw_listener = socket.create_server(("127.0.0.1", 0))
        self.raw_nixl: Any = None
        self.raw_remote_names: set[str] = set()

    async def start(self) -> dict[str, Any]:
        names = ["tcp"] + (["nixl"] if not nixl_status() else [])
        for name in names:
            receiver = registry.get_backend(name).create_receiver(self.cache, self.owners)
            self.receivers[name] = receiver
            self.addresses[name] = await receiver.start("127.0.0.1", 0)
        info: dict[str, Any] = {"addresses": self.addresses,
                                "raw_tcp_port": self.raw_listener.getsockname()[1]}
        if "nixl" in names:
            from pdserve.worker.transports.nixl.agent import NixlAgent

            self.raw_nixl = NixlAgent(self.cache, "raw-recv")
        return info

    def raw_tcp_receive(self, dst_ids: list[int]) -> None:
        """Blocking, in a thread: accept one connection, fill every destination block of every
        layer in order, then ACK with one byte."""
        sock, _ = self.raw_listener.accept()
        with sock:
            for buffer in self.cache.layer_buffers:
                for block_id in dst_ids:
                    view = memoryview(buffer[block_id])
                    got = 0
                    while got < len(view):
                        n = sock.recv_into(view[got:])
                        if n == 0:
                            raise ConnectionError("raw sender closed early")
                        got += n
            sock.sendall(b"\x01")

    def raw_nixl_read(self, name: str, metadata: bytes, bases: list[int], src_ids: list[int],
                      dst_ids: list[int]) -> None:
        """Bare NIXL: one READ per layer of the same descriptors our receiver builds, all posted
        at once, spinning on progress until every one is done."""
        from pdserve.worker.transports.nixl.agent import read_descriptors

        agent = self.raw_nixl
        if name not in self.raw_remote_names:
            agent.add_remote(name, metadata)
            self.raw_remote_names.add(name)
        dst, src = np.asarray(dst_ids), np.asarray(src_ids)
        handles = []
        for layer, base in enumerate(bases):
            local, remote = read_descriptors(agent, layer, dst, base, src)
            handle = agent.agent.initialize_xfer("READ", agent.agent.get_xfer_descs(local, "DRAM"),
                                                 agent.agent.get_xfer_descs(remote, "DRAM"), name)
            handles.append((handle, agent.agent.transfer(handle)))
        for handle, status in handles:
            while status == "PROC":
                status = agent.agent.check_xfer_state(handle)
            if status != "DONE":
                raise RuntimeError(f"raw NIXL READ failed: {status}")
            handle.release()


class TinyDecode:
    """A decode ``WorkerAgent`` over the default tiny model, for the exposed-time table."""

    def __init__(self, transport: str) -> None:
        from pdserve.worker.agent import AgentConfig
        from pdserve.worker.engines.tiny import TinyEngine
        from pdserve.worker.scheduler.agents import create_agent

        self.agent = create_agent(AgentConfig("bench-decode", "tiny", WorkerRole.DECODE,
                                              transport=transport),
                                  TinyEngine(), registry.get_backend(transport))
        self.streams: dict[str, asyncio.Task[list[int]]] = {}

    async def start(self) -> None:
        await self.agent.start()
        self.agent.state = WorkerState.READY

    def admit(self, token_text: str, prompt: list[int]) -> dict[str, Any]:
        token = FencingToken.parse(token_text)
        num_blocks = self.agent.engine.layout.num_blocks_for(len(prompt) + 1)
        dest = self.agent.admit(token, len(prompt), num_blocks)

        async def consume() -> list[int]:
            tokens: list[int] = []
            async for chunk, _ in self.agent.decode(token, prompt, 1):
                tokens += chunk
            return tokens

        self.streams[token_text] = asyncio.ensure_future(consume())
        return {"kv_address": dest.kv_address, "block_ids": list(dest.block_ids),
                "metadata": dest.metadata}


async def _serve(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    rigs: dict[tuple[int, int], ReceiverRig] = {}
    tiny: dict[str, TinyDecode] = {}
    while True:
        command, args = await loop.run_in_executor(None, conn.recv)
        if command == "quit":
            break
        try:
            reply = await _handle(command, args, rigs, tiny)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails loudly
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)
    for rig in rigs.values():
        for receiver in rig.receivers.values():
            await receiver.close()
    for decode in tiny.values():
        await decode.agent.close()


async def _handle(command: str, args: dict[str, Any], rigs: dict[tuple[int, int], ReceiverRig],
                  tiny: dict[str, TinyDecode]) -> Any:
    if command == "rig":
        layout = KvLayout(**args["layout"])
        rig = ReceiverRig(layout)
        rigs[(layout.num_blocks, layout.block_nbytes)] = rig
        return await rig.start()
    if command == "tiny_start":
        decode = TinyDecode(args["transport"])
        await decode.start()
        tiny[args["transport"]] = decode
        return {"ok": True}
    if command == "tiny_admit":
        return tiny[args["transport"]].admit(args["token"], args["prompt"])
    if command == "tiny_collect":
        return await tiny[args["transport"]].streams.pop(args["token"])
    rig = rigs[tuple(args["rig"])]  # type: ignore[index]
    if command == "expect":
        token = FencingToken.parse(args["token"])
        rig.owners.assign(token, args["dst_ids"])
        rig.receivers[args["transport"]].expect(token, args["dst_ids"], NUM_LAYERS)
        return {"ok": True}
    if command == "wait":
        token = FencingToken.parse(args["token"])
        result = await rig.receivers[args["transport"]].wait(token, 60.0)
        rig.receivers[args["transport"]].cancel(token, "collected")
        rig.owners.release(token)
        return {"num_bytes": result.num_bytes}
    if command == "raw_tcp":
        thread = threading.Thread(target=rig.raw_tcp_receive, args=(args["dst_ids"],))
        thread.start()
        return {"ok": True}
    if command == "raw_nixl":
        rig.raw_nixl_read(args["name"], args["metadata"], args["bases"], args["src_ids"],
                          args["dst_ids"])
        return {"ok": True}
    if command == "digest":
        return blocks_digest(rig.cache, args["dst_ids"])
    raise ValueError(f"unknown command {command!r}")


def receiver_main(conn: Connection) -> None:
    asyncio.run(_serve(conn))


# ---- the sending process ----------------------------------------------------------------------


class Peer:
    """The receiving process, driven over a pipe."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=receiver_main, args=(child,), daemon=True)
        self.process.start()

    def call(self, command: str, **args: Any) -> Any:
        self.conn.send((command, args))
        reply = self.conn.recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"receiver: {command}: {reply['error']}")
        return reply

    async def acall(self, command: str, **args: Any) -> Any:
        """``call`` without blocking the event loop (progress tasks keep running)."""
        self.conn.send((command, args))
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(None, self.conn.recv)
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"receiver: {command}: {reply['error']}")
        return reply

    def close(self) -> None:
        self.conn.send(("quit", {}))
        self.process.join(30)


class SenderRig:
    """One layout's source cache in this process, random contents."""

    def __init__(self, case: Case, peer: Peer, seed: int) -> None:
        self.case = case
        self.layout = case.layout
        self.cache = KvCache(self.layout)
        rng = np.random.default_rng(seed)
        for buffer in self.cache.layer_buffers:
            buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
        self.key = [self.layout.num_blocks, self.layout.block_nbytes]
        layout_args = {"num_layers": self.layout.num_layers, "num_blocks": self.layout.num_blocks,
                       "block_size_tokens": self.layout.block_size_tokens,
                       "block_nbytes": self.layout.block_nbytes}
        self.peer = peer
        self.info = peer.call("rig", layout=layout_args)
        self.rng = np.random.default_rng(seed + 1)
        self.is_checking = True
        """Compare destination with source after each transfer (warm-up only: it is slow)."""
        self.raw_nixl: Any = None
        if "nixl" in self.info["addresses"]:
            from pdserve.worker.transports.nixl.agent import NixlAgent

            self.raw_nixl = NixlAgent(self.cache, "raw-send")

    def placement(self) -> tuple[list[int], list[int]]:
        """Random, distinct source and destination ids (mostly not consecutive)."""
        n = self.case.num_ticket_blocks
        src = self.rng.choice(self.layout.num_blocks, n, replace=False).tolist()
        dst = self.rng.choice(self.layout.num_blocks, n, replace=False).tolist()
        return src, dst

    async def ours(self, transport: str) -> float:
        """Seconds for one ticket through our transport, sender's view (open .. finish)."""
        src, dst = self.placement()
        token = FencingToken.new()
        self.peer.call("expect", rig=self.key, transport=transport, token=str(token),
                       dst_ids=dst)
        spec = KvDestinationSpec(self.info["addresses"][transport], tuple(dst), transport,
                                 self.layout)
        sender = registry.get_backend(transport).create_sender(self.cache)
        started = time.perf_counter()
        await sender.open(spec, token)
        for layer in range(NUM_LAYERS):
            await sender.offer_layer(layer, src)
        await sender.finish(0, 0.0)
        elapsed = time.perf_counter() - started
        await sender.close()
        result = await self.peer.acall("wait", rig=self.key, transport=transport,
                                       token=str(token))
        assert result["num_bytes"] == self.case.num_bytes, result
        self._check(src, dst)
        return elapsed

    def raw_tcp(self) -> float:
        src, dst = self.placement()
        self.peer.call("raw_tcp", rig=self.key, dst_ids=dst)
        views = [memoryview(buffer[block_id]) for buffer in self.cache.layer_buffers
                 for block_id in src]
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.info["raw_tcp_port"])) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for view in views:
                sock.sendall(view)
            if sock.recv(1) != b"\x01":
                raise ConnectionError("no ACK from the raw receiver")
        elapsed = time.perf_counter() - started
        self._check(src, dst)
        return elapsed

    def raw_nixl_read(self) -> float:
        src, dst = self.placement()
        agent = self.raw_nixl
        args = {"rig": self.key, "name": agent.name, "metadata": agent.metadata,
                "bases": [int(b) for b in agent.base_addresses], "src_ids": src, "dst_ids": dst}
        started = time.perf_counter()
        self.peer.conn.send(("raw_nixl", args))
        while not self.peer.conn.poll(0):  # the target keeps progressing, as a sender must
            agent.progress()
        reply = self.peer.conn.recv()
        elapsed = time.perf_counter() - started
        if "error" in reply:
            raise RuntimeError(reply["error"])
        self._check(src, dst)
        return elapsed

    def _check(self, src: list[int], dst: list[int]) -> None:
        if not self.is_checking:
            return
        if blocks_digest(self.cache, src) != self.peer.call("digest", rig=self.key, dst_ids=dst):
            raise AssertionError(f"{self.case.label}: destination blocks differ from the source")


async def bandwidth_table(peer: Peer, num_runs: int, has_nixl: bool) -> dict[str, dict[str, float]]:
    """``{case label: {variant: median seconds}}``; variants interleaved run by run."""
    results: dict[str, dict[str, float]] = {}
    for seed, case in enumerate(CASES):
        rig = SenderRig(case, peer, seed)
        variants = _variants(rig, has_nixl)
        for run in variants.values():  # warm-up (connections, NIXL wire-up), checked
            await run()
        rig.is_checking = False
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(num_runs):
            for name, run in variants.items():
                times[name].append(await run())
        results[case.label] = {name: statistics.median(values) for name, values in times.items()}
    return results


def _variants(rig: SenderRig, has_nixl: bool) -> dict[str, Any]:
    """Name -> coroutine function returning one run's seconds."""

    async def raw_tcp() -> float:
        return rig.raw_tcp()

    async def raw_nixl() -> float:
        return rig.raw_nixl_read()

    variants: dict[str, Any] = {"raw_tcp": raw_tcp, "tcp": lambda: rig.ours("tcp")}
    if has_nixl:
        variants["raw_nixl"] = raw_nixl
        variants["nixl"] = lambda: rig.ours("nixl")
    return variants


async def exposed_table(peer: Peer, lengths: list[int], transports: list[str]
                        ) -> list[dict[str, Any]]:
    from pdserve.worker.agent import AgentConfig
    from pdserve.worker.engines.tiny import TinyEngine
    from pdserve.worker.scheduler.agents import create_agent

    rows = []
    rng = np.random.default_rng(0)
    for transport in transports:
        await peer.acall("tiny_start", transport=transport)
        prefill = create_agent(AgentConfig("bench-prefill", "tiny", WorkerRole.PREFILL,
                                           transport=transport),
                               TinyEngine(), registry.get_backend(transport))
        await prefill.start()
        prefill.state = WorkerState.READY
        layout = prefill.engine.layout
        try:
            for index, num_tokens in enumerate([64, *lengths]):  # the first one warms up
                prompt = rng.integers(3, 256, num_tokens).tolist()
                token = FencingToken.new()
                dest = await peer.acall("tiny_admit", transport=transport, token=str(token),
                                        prompt=prompt)
                spec = KvDestinationSpec(dest["kv_address"], tuple(dest["block_ids"]), transport,
                                         layout, dest["metadata"])
                first, timing, _ = await prefill.prefill(token, prompt, spec, lease_s=300.0)
                tokens = await peer.acall("tiny_collect", transport=transport, token=str(token))
                assert tokens == [first], (tokens, first)
                if index == 0:
                    continue
                rows.append({"transport": transport, "tokens": num_tokens,
                             "prefill_s": timing.prefill_compute_s,
                             "transfer_s": timing.transfer_s, "exposed_s": timing.exposed_s,
                             "num_bytes": timing.num_bytes})
        finally:
            await prefill.close()
    return rows


def _print_bandwidth(results: dict[str, dict[str, float]], has_nixl: bool) -> dict[str, Any]:
    print("KV transfer bandwidth (GB/s; median; per layer, random non-contiguous blocks; "
          "receiver in another process)")
    header = f"{'size':>8} {'raw tcp':>9} {'tcp':>9} {'tcp/raw':>8}"
    if has_nixl:
        header += f" {'raw nixl':>9} {'nixl':>9} {'nixl/raw':>9}"
    print(header)
    ratios: dict[str, Any] = {}
    for case in CASES:
        times = results[case.label]
        gbps = {name: case.num_bytes / seconds / 1e9 for name, seconds in times.items()}
        tcp_ratio = times["raw_tcp"] / times["tcp"]
        line = f"{case.label:>8} {gbps['raw_tcp']:9.2f} {gbps['tcp']:9.2f} {tcp_ratio:8.2f}"
        ratios[f"tcp_vs_raw_{case.label}"] = round(tcp_ratio, 3)
        if has_nixl:
            nixl_ratio = times["raw_nixl"] / times["nixl"]
            line += f" {gbps['raw_nixl']:9.2f} {gbps['nixl']:9.2f} {nixl_ratio:9.2f}"
            ratios[f"nixl_vs_raw_{case.label}"] = round(nixl_ratio, 3)
        else:
            ratios[f"nixl_vs_raw_{case.label}"] = None
        print(line)
    return ratios


def _print_exposed(rows: list[dict[str, Any]]) -> float:
    print()
    print("Tiny model (8 layers, default config): exposed transfer vs prefill compute")
    print(f"{'transport':>9} {'tokens':>7} {'KV MiB':>7} {'prefill ms':>11} {'transfer ms':>12} "
          f"{'exposed ms':>11} {'exposed/prefill':>16}")
    worst = 0.0
    for row in rows:
        ratio = row["exposed_s"] / row["prefill_s"]
        worst = max(worst, ratio)
        print(f"{row['transport']:>9} {row['tokens']:7d} {row['num_bytes'] / MiB:7.1f} "
              f"{row['prefill_s'] * 1e3:11.1f} {row['transfer_s'] * 1e3:12.1f} "
              f"{row['exposed_s'] * 1e3:11.2f} {ratio:16.4f}")
    return worst


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    why = nixl_status()
    has_nixl = not why
    if not has_nixl:
        print(f"nixl: unavailable ({why}); its columns are skipped", file=sys.stderr)
    peer = Peer()
    try:
        results = await bandwidth_table(peer, args.runs, has_nixl)
        ratios = _print_bandwidth(results, has_nixl)
        transports = ["tcp"] + (["nixl"] if has_nixl else [])
        rows = await exposed_table(peer, args.lengths, transports)
        worst = _print_exposed(rows)
    finally:
        peer.close()
    return {**ratios, "exposed_over_prefill_max": round(worst, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per size and variant")
    parser.add_argument("--lengths", type=lambda text: [int(x) for x in text.split(",")],
                        default=[256, 512, 1024, 2048, 4096], help="tiny prompt lengths")
    args = parser.parse_args()
    started = time.perf_counter()
    summary = asyncio.run(main_async(args))
    summary["runtime_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
