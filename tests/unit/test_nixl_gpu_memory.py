"""A KV cache in GPU memory under the ``nixl`` transport, on a machine without a GPU: what can be
checked is everything up to NIXL itself.

- vLLM's per-layer tensors on one CUDA device become a ``VllmKvCache`` with no host buffers whose
  ``memory`` names VRAM, the device and each layer's address and size;
- the NIXL agent registers exactly those regions as VRAM (a recording stand-in for the ``nixl``
  module: the real one is exercised with host memory in ``test_nixl_transport``);
- a HELLO carries the sender's memory type and device (a host-memory HELLO is the bytes it always
  was), and READ descriptors name each side's device;
- the byte access a GPU cache's checksums and zeroing use (torch indexing, then a copy to the
  host) gives the host path's results, run here on CPU tensors.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdserve.worker.engine import KvCache, KvLayout, KvMemory
from pdserve.worker.kv_checksums import kv_checksum
from pdserve.worker.transports.nixl import agent as nixl_agent
from pdserve.worker.transports.nixl import control
from pdserve.worker.transports.nixl.agent import NixlAgent, memory_regions, read_descriptors

NUM_BLOCKS = 8
LAYER_SHAPE = (NUM_BLOCKS, 2, 16, 64)  # blocks first, as vLLM's caches are
ELEMENT_SIZE = 2  # bfloat16
LAYER_NBYTES = int(np.prod(LAYER_SHAPE)) * ELEMENT_SIZE


class CudaTensorStandIn:
    """What ``VllmKvCache`` reads of a CUDA tensor, and nothing else."""

    def __init__(self, address: int, device_index: int) -> None:
        self.device = SimpleNamespace(type="cuda", index=device_index)
        self.shape = LAYER_SHAPE
        self._address = address

    def __str__(self) -> str:
        return f"cuda:{self.device.index}"

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return int(np.prod(LAYER_SHAPE))

    def element_size(self) -> int:
        return ELEMENT_SIZE

    def data_ptr(self) -> int:
        return self._address


def _gpu_cache(device_index: int = 3) -> Any:
    worker_side = pytest.importorskip("pdserve.worker.engines.vllm.worker_side")
    tensors = [CudaTensorStandIn(0x7F00_0000_0000 + i * LAYER_NBYTES, device_index)
               for i in range(4)]
    return worker_side.VllmKvCache(tensors, block_size_tokens=16)


def test_a_cache_on_a_cuda_device_is_described_as_that_gpus_memory() -> None:
    cache = _gpu_cache()
    assert cache.layer_buffers == []  # nothing of it is host memory
    assert cache.layout == KvLayout(num_layers=4, num_blocks=NUM_BLOCKS, block_size_tokens=16,
                                    block_nbytes=LAYER_NBYTES // NUM_BLOCKS)
    memory = cache.memory
    assert (memory.kind, memory.device_id, memory.is_host) == ("VRAM", 3, False)
    assert memory.layer_addresses == tuple(0x7F00_0000_0000 + i * LAYER_NBYTES for i in range(4))
    assert memory.layer_nbytes == (LAYER_NBYTES,) * 4
    assert memory_regions(memory)[1] == (0x7F00_0000_0000 + LAYER_NBYTES, LAYER_NBYTES, 3, "")


def test_layers_on_two_devices_are_refused() -> None:
    worker_side = pytest.importorskip("pdserve.worker.engines.vllm.worker_side")
    with pytest.raises(NotImplementedError, match="one host or one CUDA device"):
        worker_side.VllmKvCache([CudaTensorStandIn(4096, 0), CudaTensorStandIn(8192, 1)], 16)


class RecordingNixl:
    """Stands in for the ``nixl`` module: records what an agent registers."""

    def __init__(self) -> None:
        self.registered: list[tuple[list[tuple[int, int, int, str]], str]] = []
        recorder = self

        class Agent:
            backends = ["UCX"]

            def __init__(self, name: str, config: object) -> None:
                self.name = name

            def register_memory(self, regions: list[tuple[int, int, int, str]],
                                mem_type: str) -> object:
                recorder.registered.append((regions, mem_type))
                return object()

            def get_agent_metadata(self) -> bytes:
                return b"metadata"

            def deregister_memory(self, registration: object) -> None:
                pass

        self.nixl_agent = Agent

    @staticmethod
    def nixl_agent_config(**_: object) -> object:
        return object()


def test_the_agent_registers_a_gpu_cache_as_vram_of_its_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _gpu_cache(device_index=5)
    fake = RecordingNixl()
    monkeypatch.setattr(nixl_agent, "load_nixl", lambda: (fake, ""))
    agent = NixlAgent(cache, "decode")
    ((regions, mem_type),) = fake.registered
    assert mem_type == "VRAM"
    assert regions == memory_regions(cache.memory)
    assert (agent.memory_kind, agent.device_id) == ("VRAM", 5)
    assert agent.base_addresses.tolist() == list(cache.memory.layer_addresses)

    # READ descriptors: destination runs on this GPU, source runs on the sender's.
    local, remote = read_descriptors(agent, 1, np.array([2, 3, 6]), 1 << 40, np.array([0, 1, 4]),
                                     remote_device_id=2)
    assert local[:, 2].tolist() == [5, 5] and remote[:, 2].tolist() == [2, 2]
    block = cache.layout.block_nbytes
    assert local[:, 0].tolist() == [cache.memory.layer_addresses[1] + 2 * block,
                                    cache.memory.layer_addresses[1] + 6 * block]
    assert local[:, 1].tolist() == [2 * block, block]
    agent.close()


def test_a_host_cache_registers_as_dram_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = KvCache(KvLayout(num_layers=2, num_blocks=4, block_size_tokens=16, block_nbytes=512))
    fake = RecordingNixl()
    monkeypatch.setattr(nixl_agent, "load_nixl", lambda: (fake, ""))
    NixlAgent(cache, "prefill").close()
    ((regions, mem_type),) = fake.registered
    assert mem_type == "DRAM"
    assert regions == [(b.ctypes.data, b.nbytes, 0, "") for b in cache.layer_buffers]


def test_hello_names_the_senders_memory_and_a_host_hello_is_unchanged() -> None:
    def hello(**memory: Any) -> control.Hello:
        return control.Hello(3, 16, 2048, 64, np.array([5, 1, 9]),
                             np.array([10, 20, 30], np.uint64), "agent-x", b"meta", **memory)

    host = hello().encode()
    # What receivers before the memory trailer read: header fields, ids, bases, name, metadata.
    assert len(host) == struct_size_of_hello() + 8 * 3 + 8 * 3 + len(b"agent-x") + len(b"meta")
    decoded = control.Hello.decode(host, max_blocks=32, max_layers=3)
    assert (decoded.memory_kind, decoded.device_id, decoded.metadata) == ("DRAM", 0, b"meta")

    gpu = hello(memory_kind="VRAM", device_id=7).encode()
    decoded = control.Hello.decode(gpu, max_blocks=32, max_layers=3)
    assert (decoded.memory_kind, decoded.device_id, decoded.metadata) == ("VRAM", 7, b"meta")
    with pytest.raises(control.ControlError, match="memory type"):
        control.Hello.decode(host + (9).to_bytes(4, "little") + bytes(4), 32, 3)
    with pytest.raises(control.ControlError):
        control.Hello.decode(gpu + b"!", max_blocks=32, max_layers=3)


def struct_size_of_hello() -> int:
    return control._HELLO.size


def test_gpu_byte_access_matches_the_host_path_on_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    worker_side = pytest.importorskip("pdserve.worker.engines.vllm.worker_side")
    generator = torch.Generator().manual_seed(11)
    tensors = [torch.randint(-1000, 1000, LAYER_SHAPE, generator=generator).to(torch.bfloat16)
               for _ in range(3)]
    host = worker_side.VllmKvCache(tensors, 16)
    device_path = worker_side.VllmKvCache([t.clone() for t in tensors], 16)
    # The torch path a CUDA cache takes, on CPU tensors: no host views, its memory VRAM.
    device_path._is_host = False
    device_path.layer_buffers = []
    device_path._memory = dataclasses.replace(device_path.memory, kind="VRAM")
    ids = np.array([6, 0, 3])
    assert kv_checksum(device_path, ids) == kv_checksum(host, ids)
    assert worker_side.block_crc32s(device_path, ids) == worker_side.block_crc32s(host, ids)
    device_path.zero_blocks(np.array([0, 3]))
    host.zero_blocks(np.array([0, 3]))
    for layer in range(3):
        assert np.array_equal(device_path.layer_blocks(layer, np.arange(NUM_BLOCKS)),
                              host.layer_blocks(layer, np.arange(NUM_BLOCKS)))
    assert not device_path.layer_blocks(1, np.array([3])).any()
    assert device_path.layer_blocks(1, np.array([6])).any()
    assert isinstance(host.memory, KvMemory) and host.memory.is_host


def test_a_layout_with_k_and_v_before_the_blocks_is_refused() -> None:
    """FlashAttention's ``[2, num_blocks, ...]`` would make "block" 0 half of every block's
    layer; with vLLM's block count known, the first dimension must be it."""
    torch = pytest.importorskip("torch")
    worker_side = pytest.importorskip("pdserve.worker.engines.vllm.worker_side")
    k_and_v_first = [torch.zeros((2, NUM_BLOCKS, 16, 64)) for _ in range(2)]
    with pytest.raises(NotImplementedError, match="block index first"):
        worker_side.VllmKvCache(k_and_v_first, 16, expected_num_blocks=NUM_BLOCKS)
    blocks_first = [torch.zeros((NUM_BLOCKS, 2, 16, 64)) for _ in range(2)]
    cache = worker_side.VllmKvCache(blocks_first, 16, expected_num_blocks=NUM_BLOCKS)
    assert cache.layout.num_blocks == NUM_BLOCKS and cache.memory.is_host
