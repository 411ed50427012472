"""What TLS costs the KV data path: tcp in clear against tcp + mutual TLS, same run.

A receiver (decode side) runs in a child process with its own event loop, as on a real decode
worker; the parent is the sender (prefill side). Each transfer is one ticket on a fresh
connection — connect, TLS handshake (TLS only), HELLO, every layer of every block, DONE and its
ACK — so the figure is what a request pays, handshake included. The layout is one 16-token
block of a Llama-3-8B-like model per layer (64 KiB per layer-block, 32 layers), destination
block ids shuffled (non-contiguous, as after some churn). Sizes: 16 MiB (8 blocks: a 128-token
prompt) and 256 MiB (128 blocks: 2,048 tokens). Modes alternate, so both see the same machine
load; the median of the repetitions is reported. The first transfer of each mode is checked
byte for byte (SHA-256 of the destination blocks against the source).

    python bench/tls_cost.py [--repeats 5]

Last line: one JSON object with clear and TLS bandwidth (GB/s) per size and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.common.certs import make_dev_certs
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache, KvLayout
from pdserve.worker.kv_owner import BlockOwnerTable
from pdserve.worker.transports.tcp.backend import TcpBackend
from pdserve.worker.transports.tcp.settings import KvTls, TcpTransportSettings
from pdserve.worker.transports.values import KvDestinationSpec

NUM_LAYERS = 32
BLOCK_NBYTES = 64 * 1024
"""Bytes of one block in one layer: 2 (K, V) x 8 KV heads x 128 dims x 2 bytes x 16 tokens."""
SIZES_MIB = (16, 256)
NUM_BLOCKS = 160
NEGOTIATED: dict[str, str] = {}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def layout() -> KvLayout:
    return KvLayout(num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS, block_size_tokens=16,
                    block_nbytes=BLOCK_NBYTES)


def backend(tls_files: tuple[Path, Path, Path] | None) -> TcpBackend:
    if tls_files is None:
        return TcpBackend()
    return TcpBackend(TcpTransportSettings(tls=KvTls(*tls_files)))


def digest(cache: KvCache, block_ids: list[int]) -> str:
    sha = hashlib.sha256()
    for buffer in cache.layer_buffers:
        sha.update(buffer[block_ids].tobytes())
    return sha.hexdigest()


# ------------------------------------------------------------------------- receiver process


def receiver_main(connection: mp.connection.Connection,
                  tls_files: tuple[Path, Path, Path]) -> None:
    asyncio.run(_receive(connection, tls_files))


async def _receive(connection: mp.connection.Connection,
                   tls_files: tuple[Path, Path, Path]) -> None:
    """Commands from the parent: ``("expect", mode, token, block_ids)`` -> ``(address, cpu
    seconds so far)``, ``("wait", mode, token, block_ids)`` -> ``(digest, cpu seconds so
    far)``, ``("stop",)``."""
    cache = KvCache(layout())
    owners = {mode: BlockOwnerTable(NUM_BLOCKS) for mode in ("clear", "tls")}
    receivers = {
        "clear": backend(None).create_receiver(cache, owners["clear"]),
        "tls": backend(tls_files).create_receiver(cache, owners["tls"]),
    }
    addresses = {mode: await r.start("127.0.0.1", 0) for mode, r in receivers.items()}
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, connection.recv)
        if command[0] == "stop":
            break
        _, mode, token_text, block_ids = command
        token = FencingToken.parse(token_text)
        if command[0] == "expect":
            owners[mode].assign(token, block_ids)
            receivers[mode].expect(token, block_ids, NUM_LAYERS)
            connection.send((addresses[mode], time.process_time()))
        else:
            await receivers[mode].wait(token, 120.0)
            cpu_s = time.process_time()
            connection.send((digest(cache, block_ids), cpu_s))
            owners[mode].release(token)
    for receiver in receivers.values():
        await receiver.close()


# ------------------------------------------------------------------------------- sender side


async def transfer(connection: mp.connection.Connection, source: KvCache, mode: str,
                   tls_files: tuple[Path, Path, Path], size_mib: int,
                   rng: np.random.Generator) -> tuple[float, float, float, str, str]:
    """One ticket of ``size_mib``: ``(seconds, sender cpu seconds, receiver cpu seconds,
    source digest, destination digest)``."""
    num_blocks = size_mib * 1024 * 1024 // (NUM_LAYERS * BLOCK_NBYTES)
    dst = [int(b) for b in rng.permutation(NUM_BLOCKS)[:num_blocks]]
    src = [int(b) for b in rng.permutation(NUM_BLOCKS)[:num_blocks]]
    token = FencingToken.new()
    connection.send(("expect", mode, str(token), dst))
    address, receiver_cpu_s = connection.recv()
    sender = backend(tls_files if mode == "tls" else None).create_sender(source)
    started = time.perf_counter()
    started_cpu_s = time.process_time()
    await sender.open(KvDestinationSpec(address, tuple(dst), "tcp", layout()), token)
    for layer in range(NUM_LAYERS):
        await sender.offer_layer(layer, src)
    await sender.finish(1, 0.0)
    elapsed_s = time.perf_counter() - started
    sender_cpu_s = time.process_time() - started_cpu_s
    tls_object = getattr(getattr(sender, "_io", None), "_tls", None)  # for the report only
    if tls_object is not None:
        NEGOTIATED["cipher"] = "/".join(str(x) for x in tls_object.cipher()[:2])
    await sender.close()
    connection.send(("wait", mode, str(token), dst))
    landed, receiver_done_cpu_s = connection.recv()
    return (elapsed_s, sender_cpu_s, receiver_done_cpu_s - receiver_cpu_s,
            digest(source, src), landed)


async def run(repeats: int, tls_files: tuple[Path, Path, Path],
              connection: mp.connection.Connection) -> dict[str, object]:
    source = KvCache(layout())
    rng = np.random.default_rng(0)
    for buffer in source.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    seconds: dict[tuple[int, str], list[float]] = {}
    cpu: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for size_mib in SIZES_MIB:
        for _ in range(1):  # warm-up: imports, first connections, page faults
            for mode in ("clear", "tls"):
                await transfer(connection, source, mode, tls_files, size_mib, rng)
        for repeat in range(repeats):
            for mode in (("clear", "tls") if repeat % 2 == 0 else ("tls", "clear")):
                elapsed_s, sender_cpu_s, receiver_cpu_s, sent, landed = await transfer(
                    connection, source, mode, tls_files, size_mib, rng)
                if sent != landed:
                    raise SystemExit(f"{mode} {size_mib} MiB: destination differs from source")
                seconds.setdefault((size_mib, mode), []).append(elapsed_s)
                cpu.setdefault((size_mib, mode), []).append((sender_cpu_s, receiver_cpu_s))
                log(f"  {size_mib:>4} MiB {mode:<5} {elapsed_s * 1000:8.1f} ms")
    results: dict[str, object] = {}
    print(f"{'size':>8}  {'mode':<7}  {'GB/s':>6}  {'vs clear':>8}  "
          f"{'sender CPU s/GiB':>16}  {'receiver CPU s/GiB':>18}")
    for size_mib in SIZES_MIB:
        gbps = {mode: size_mib * 1024**2 / statistics.median(seconds[(size_mib, mode)]) / 1e9
                for mode in ("clear", "tls")}
        for mode in ("clear", "tls"):
            per_gib = [statistics.median(c[i] for c in cpu[(size_mib, mode)]) * 1024 / size_mib
                       for i in (0, 1)]
            label = "tcp" if mode == "clear" else "tcp+TLS"
            print(f"{size_mib:>5} MiB  {label:<7}  {gbps[mode]:>6.3f}  "
                  f"{gbps[mode] / gbps['clear']:>8.2f}  {per_gib[0]:>16.2f}  {per_gib[1]:>18.2f}")
            results[f"{mode}_{size_mib}mib_gbps"] = round(gbps[mode], 3)
            results[f"{mode}_{size_mib}mib_sender_cpu_s_per_gib"] = round(per_gib[0], 3)
            results[f"{mode}_{size_mib}mib_receiver_cpu_s_per_gib"] = round(per_gib[1], 3)
        results[f"tls_over_clear_{size_mib}mib"] = round(gbps["tls"] / gbps["clear"], 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cert = make_dev_certs(Path(tmp), ["worker"])[0]
        tls_files = (cert.cert_path, cert.key_path, Path(tmp) / "ca.pem")
        context = mp.get_context("spawn")
        parent_end, child_end = context.Pipe()
        child = context.Process(target=receiver_main, args=(child_end, tls_files), daemon=True)
        child.start()
        try:
            results = asyncio.run(run(args.repeats, tls_files, parent_end))
        finally:
            parent_end.send(("stop",))
            child.join(30)
    results["repeats"] = args.repeats
    results["openssl"] = ssl.OPENSSL_VERSION
    results["cipher"] = NEGOTIATED.get("cipher", "")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
