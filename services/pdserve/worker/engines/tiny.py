"""``tiny``: a small real decoder-only transformer in numpy (float32) over a paged KV cache.

Its purpose is to make the KV that crosses the wire real: a prompt prefilled on one worker and
decoded on another must produce exactly the tokens of prefill and decode on one worker, provided
the KV bytes arrive intact. So attention (in decode *and* prefill) always reads K/V back from the
paged cache through the sequence's block table; whatever a transport wrote there is what is used.

Model: Llama-shaped. Token embedding -> ``num_layers`` x [RMSNorm -> attention with rotary position
embedding (half-split rotation) and grouped-query heads (``num_kv_heads`` may be < ``num_heads``;
query head h reads KV head ``h // (num_heads // num_kv_heads)``) -> residual -> RMSNorm -> SwiGLU
MLP -> residual] -> RMSNorm -> output head (tied to the embedding or separate) -> greedy argmax.
Weights are drawn from ``numpy.random.default_rng(seed)``; the vocabulary is the package
tokenizer's (``pdserve.common.tokenizer``).

Bit-exact agreement between two workers needs identical weights (compare
``TinyEngine.weights_fingerprint``), the same numpy/BLAS build, the same CPU kernel family and the
same BLAS thread count: OpenBLAS was seen to compute the prefill attention product
``[4 x 128, 2000] @ [2000, 32]`` differently with 1 and 2 threads. Run ``tiny`` workers with
``OPENBLAS_NUM_THREADS=1`` (set before numpy is imported); it is also the fastest setting for
these matrix sizes.

KV cache: each layer's ``uint8[num_blocks, block_nbytes]`` buffer is viewed (no copy) as
``float32[num_blocks, 2, block_size_tokens, num_kv_heads, head_dim]`` (axis 1: 0 = K, 1 = V;
K is stored after rotation). Prefill writes whole blocks, zero-filling the unused tail of the last
one, and decode clears a block when it starts filling it, so a block's bytes depend only on the
sequence's tokens (checksums of equal prefixes agree).

Batch invariance (a sequence's tokens do not depend on what else is in the batch): decode computes
every sequence on its own -- one 1-D token vector per matmul, reduction and softmax -- so each
sequence always runs the identical sequence of numpy/BLAS calls with identical shapes, whatever the
batch holds. Chosen over one batched ``[batch, hidden] @ W`` because BLAS may pick different
kernels (gemv vs gemm, different edge tiles) for different batch sizes and so a different summation
order; the colocated-vs-disaggregated check would then compare batch compositions instead of KV.
To keep it fast anyway, a step runs layer by layer and, within a layer, matrix by matrix: all
sequences' products with one weight matrix run back to back while that matrix is in cache, so each
weight is read from memory about once per step rather than once per sequence. The order in which
sequences are visited does not change any sequence's arithmetic. Prefill runs one sequence at a
time and shares no state with other calls (no scratch buffers), so its KV is the same whatever else
runs, and prefill generator steps may interleave with decode steps of other sequences.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pdserve.common import tokenizer
from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.engine import KvCache, KvLayout, Sequence

_F32 = np.float32
_F32_NBYTES = 4
# Queries per attention chunk in prefill: the chunk's scores, num_heads x chunk x context floats
# (8 x 32 x 4096 x 4 B = 4 MiB at the defaults), stay in cache through the softmax passes;
# measured fastest of 16..256 on a 2,000-token prompt.
_PREFILL_QUERY_CHUNK = 32


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Shape, cache size and seed of a ``TinyEngine``.

    ``head_dim = hidden_size / num_heads`` (must divide, and be even for the rotation);
    ``num_heads`` must be a multiple of ``num_kv_heads``. ``num_blocks`` is per layer; the default
    (1024 blocks of 16 tokens) holds four 4K-token sequences in 64 MiB of KV over 8 layers.
    ``max_context_tokens`` bounds prompt plus generated tokens of one sequence.
    """

    num_layers: int = 8
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = tokenizer.VOCAB_SIZE
    block_size_tokens: int = 16
    num_blocks: int = 1024
    max_context_tokens: int = 4096
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    has_tied_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
            "vocab_size", "block_size_tokens", "num_blocks", "max_context_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embedding")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_block_nbytes(self) -> int:
        """Bytes of one block of one layer: K and V, float32."""
        return 2 * self.block_size_tokens * self.num_kv_heads * self.head_dim * _F32_NBYTES

    def layout(self) -> KvLayout:
        return KvLayout(
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_size_tokens=self.block_size_tokens,
            block_nbytes=self.kv_block_nbytes,
        )


@dataclass(frozen=True, slots=True)
class _LayerWeights:
    """One decoder layer; matrices are ``[in, out]`` so activations multiply from the left."""

    attn_norm: np.ndarray  # [hidden]
    w_qkv: np.ndarray  # [hidden, (num_heads + 2 * num_kv_heads) * head_dim]
    w_o: np.ndarray  # [hidden, hidden]
    mlp_norm: np.ndarray  # [hidden]
    w_gate_up: np.ndarray  # [hidden, 2 * intermediate]
    w_down: np.ndarray  # [intermediate, hidden]


def kv_block_checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """64-bit blake2b of a KV block's bytes, as an unsigned int (compare source and destination)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).data
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class TinyEngine:
    """The ``Engine`` protocol over a real small transformer; greedy decoding, CPU, float32.

    Not thread-safe for the *same* sequence; distinct sequences (distinct blocks) may be driven
    from the agent's thread in any interleaving.
    """

    name = "tiny"

    def __init__(self, config: TinyConfig | None = None) -> None:
        self.config = config or TinyConfig()
        self.layout: KvLayout = self.config.layout()
        self.kv_cache = KvCache(self.layout)
        c = self.config
        # Per-layer float32 views of the byte buffers: [num_blocks, 2, block, kv_heads, head_dim].
        self._kv_views = [
            buffer.view(_F32).reshape(
                c.num_blocks, 2, c.block_size_tokens, c.num_kv_heads, c.head_dim
            )
            for buffer in self.kv_cache.layer_buffers
        ]
        self._init_weights()
        # Rotary tables, half-split pairs (i, i + hd/2): rotate(x) = x * cos + x[perm] * sin with
        # cos = [cos, cos] and sin = [-sin, sin] per position: [max_context, head_dim] each.
        half = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / c.head_dim))
        angles = np.outer(np.arange(c.max_context_tokens, dtype=np.float64), inv_freq)
        self._rope_cos = np.concatenate([np.cos(angles), np.cos(angles)], axis=1).astype(_F32)
        self._rope_sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1).astype(_F32)
        self._rope_perm = np.concatenate([np.arange(half, c.head_dim), np.arange(half)])
        self._k_end = (c.num_heads + c.num_kv_heads) * c.head_dim  # q | k | v in w_qkv columns
        self._attn_scale = _F32(1.0 / np.sqrt(c.head_dim))
        self._eps = _F32(c.rms_norm_eps)
        self._causal_mask = np.triu(
            np.full((_PREFILL_QUERY_CHUNK, _PREFILL_QUERY_CHUNK), -np.inf, dtype=_F32), k=1
        )
        self._fingerprint: str | None = None

    # ----------------------------------------------------------------------------------- weights

    def _init_weights(self) -> None:
        """Seeded normal weights scaled by 1/sqrt(fan_in) so activations stay O(1) in every layer.

        The query/key projections get an extra gain so attention is peaked rather than near
        uniform: outputs then depend sharply on *which* past tokens' K/V are read, which is what
        makes a wrong or missing KV block show up in the tokens.
        """
        c = self.config
        rng = np.random.default_rng(c.seed)

        def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
            return rng.standard_normal(shape, dtype=_F32) * _F32(std)

        h, hd = c.hidden_size, c.head_dim
        q_out, kv_out = c.num_heads * hd, c.num_kv_heads * hd
        self._embedding = normal((c.vocab_size, h), 1.0)
        self._layers: list[_LayerWeights] = []
        qk_gain = 2.0
        for _ in range(c.num_layers):
            w_q = normal((h, q_out), qk_gain / np.sqrt(h))
            w_k = normal((h, kv_out), qk_gain / np.sqrt(h))
            w_v = normal((h, kv_out), 1.0 / np.sqrt(h))
            self._layers.append(
                _LayerWeights(
                    attn_norm=np.ones(h, dtype=_F32),
                    w_qkv=np.ascontiguousarray(np.concatenate([w_q, w_k, w_v], axis=1)),
                    w_o=normal((q_out, h), 1.0 / np.sqrt(q_out)),
                    mlp_norm=np.ones(h, dtype=_F32),
                    w_gate_up=normal((h, 2 * c.intermediate_size), 1.0 / np.sqrt(h)),
                    w_down=normal((c.intermediate_size, h), 1.0 / np.sqrt(c.intermediate_size)),
                )
            )
        self._final_norm = np.ones(h, dtype=_F32)
        if c.has_tied_embeddings:
            self._lm_head = self._embedding.T  # [hidden, vocab], a view
        else:
            self._lm_head = normal((h, c.vocab_size), 1.0 / np.sqrt(h))

    @property
    def weights_fingerprint(self) -> str:
        """Hex blake2b of every weight (computed once): equal fingerprints, equal weights."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=16)
            arrays = [self._embedding, self._final_norm, self._lm_head]
            for layer in self._layers:
                arrays += [layer.attn_norm, layer.w_qkv, layer.w_o, layer.mlp_norm,
                           layer.w_gate_up, layer.w_down]
            for array in arrays:
                digest.update(np.ascontiguousarray(array).tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    # ------------------------------------------------------------------------------ cache helpers

    def kv_view(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s cache as ``float32[num_blocks, 2, block, kv_heads, hd]``, no copy."""
        return self._kv_views[layer]

    def block_checksum(self, layer: int, block_id: int) -> int:
        """64-bit blake2b of the bytes of one block of one layer (see ``kv_block_checksum``)."""
        return kv_block_checksum(self.kv_cache.block_view(layer, block_id))

    # ------------------------------------------------------------------------------------ prefill

    def prefill_layers(self, seq: Sequence) -> Iterator[int]:
        """See ``Engine.prefill_layers``. Validates now, computes as the iterator is advanced.

        Precondition beyond the protocol's: ``seq.num_computed_tokens == 0`` (no prefix reuse).
        Raises ``InvalidArgumentError`` for an empty or too long prompt or ids outside the
        vocabulary, ``ValueError`` for a short or out-of-range block table.
        """
        c = self.config
        num_prompt_tokens = len(seq.prompt_token_ids)
        if num_prompt_tokens == 0:
            raise InvalidArgumentError("prompt is empty", field="prompt_token_ids")
        if num_prompt_tokens > c.max_context_tokens:
            raise InvalidArgumentError(
                f"prompt has {num_prompt_tokens} tokens, context is {c.max_context_tokens}",
                field="prompt_token_ids",
            )
        token_ids = np.asarray(seq.prompt_token_ids, dtype=np.int64)
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= c.vocab_size:
            raise InvalidArgumentError(
                f"prompt token ids must be in [0, {c.vocab_size})", field="prompt_token_ids"
            )
        if seq.num_computed_tokens != 0 or seq.output_token_ids:
            raise ValueError(f"sequence {seq.request_id} is already prefilled")
        self._check_blocks(seq, self.layout.num_blocks_for(num_prompt_tokens))
        return self._prefill(seq, token_ids)

    def _prefill(self, seq: Sequence, token_ids: np.ndarray) -> Iterator[int]:
        c = self.config
        num_tokens = len(token_ids)
        num_blocks = self.layout.num_blocks_for(num_tokens)
        block_table = np.asarray(seq.block_ids[:num_blocks], dtype=np.intp)
        cos = self._rope_cos[:num_tokens, None, :]  # [T, 1, hd]
        sin = self._rope_sin[:num_tokens, None, :]
        x = self._embedding[token_ids]  # [T, hidden], a fresh copy
        for layer_index, layer in enumerate(self._layers):
            view = self._kv_views[layer_index]
            qkv = self._rms_norm(x, layer.attn_norm) @ layer.w_qkv
            qk = qkv[:, : self._k_end].reshape(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = qk * cos + qk[..., self._rope_perm] * sin
            # Whole blocks, zero tail included, K then V: [num_blocks, 2, block, kv_heads, hd].
            staged = np.zeros(
                (2, num_blocks * c.block_size_tokens, c.num_kv_heads, c.head_dim), dtype=_F32
            )
            staged[0, :num_tokens] = qk[:, c.num_heads :]
            staged[1, :num_tokens] = qkv[:, self._k_end :].reshape(
                num_tokens, c.num_kv_heads, c.head_dim
            )
            view[block_table] = staged.reshape(
                2, num_blocks, c.block_size_tokens, c.num_kv_heads, c.head_dim
            ).transpose(1, 0, 2, 3, 4)
            # Attention reads K/V back from the cache through the block table, as decode does.
            k_ctx, v_ctx = self._gather(view, block_table, num_tokens)
            attn = self._prefill_attention(qk[:, : c.num_heads], k_ctx, v_ctx)
            x = x + attn @ layer.w_o
            x = x + self._swiglu(self._rms_norm(x, layer.mlp_norm) @ layer.w_gate_up) @ layer.w_down
            yield layer_index
        next_token = self._greedy(x[-1])
        seq.num_computed_tokens = num_tokens
        seq.output_token_ids.append(next_token)

    def _prefill_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Causal GQA: ``q [T, heads, hd]``, ``k, v [T, kv_heads, hd]`` -> ``[T, hidden]``.

        Queries go in chunks of ``_PREFILL_QUERY_CHUNK``; chunk [c0, c1) scores keys [0, c1) only,
        and only its diagonal square needs the causal mask.
        """
        c = self.config
        num_tokens = q.shape[0]
        group = c.num_heads // c.num_kv_heads
        # [kv_heads, group, T, hd]: query head h reads kv head h // group.
        q_heads = (q * self._attn_scale).reshape(
            num_tokens, c.num_kv_heads, group, c.head_dim
        ).transpose(1, 2, 0, 3)
        k_heads_t = np.ascontiguousarray(k.transpose(1, 2, 0))  # [kv_heads, hd, T]
        v_heads = np.ascontiguousarray(v.transpose(1, 0, 2))  # [kv_heads, T, hd]
        out = np.empty((num_tokens, c.hidden_size), dtype=_F32)
        for c0 in range(0, num_tokens, _PREFILL_QUERY_CHUNK):
            c1 = min(c0 + _PREFILL_QUERY_CHUNK, num_tokens)
            n = c1 - c0
            q_chunk = q_heads[:, :, c0:c1].reshape(c.num_kv_heads, group * n, c.head_dim)
            scores = (q_chunk @ k_heads_t[:, :, :c1]).reshape(c.num_kv_heads, group, n, c1)
            scores[..., c0:c1] += self._causal_mask[:n, :n]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            denominators = scores.sum(axis=-1).reshape(c.num_kv_heads, group * n, 1)
            ctx = scores.reshape(c.num_kv_heads, group * n, c1) @ v_heads[:, :c1]
            ctx /= denominators  # [kv_heads, group * n, hd]
            out[c0:c1] = (
                ctx.reshape(c.num_kv_heads, group, n, c.head_dim)
                .transpose(2, 0, 1, 3)
                .reshape(n, c.hidden_size)
            )
        return out

    # ------------------------------------------------------------------------------------- decode

    def decode_step(self, seqs: list[Sequence]) -> list[int]:
        """See ``Engine.decode_step``; each sequence is computed on its own (batch invariance).

        Each sequence must be prefilled (``num_computed_tokens == num_tokens - 1``: the last
        output token is the one whose KV this step writes, at position ``num_computed_tokens``)
        and have a block for that position; raises ``ValueError`` otherwise.
        """
        c = self.config
        positions: list[int] = []
        for seq in seqs:
            position = seq.num_computed_tokens
            if not seq.output_token_ids or position != seq.num_tokens - 1:
                raise ValueError(
                    f"sequence {seq.request_id} is not ready to decode: "
                    f"{position} computed of {seq.num_tokens} tokens"
                )
            if position >= c.max_context_tokens:
                raise ValueError(
                    f"sequence {seq.request_id} reached the context limit {c.max_context_tokens}"
                )
            self._check_blocks(seq, position // c.block_size_tokens + 1)
            positions.append(position)
        block_tables = [
            np.asarray(seq.block_ids[: pos // c.block_size_tokens + 1], dtype=np.intp)
            for seq, pos in zip(seqs, positions, strict=True)
        ]
        xs = [self._embedding[seq.output_token_ids[-1]] for seq in seqs]  # each [hidden], a copy
        # Layer-major, and within a layer matrix-major: every sequence's 1-D product with one
        # weight matrix runs back to back, so that matrix is read from memory once per step.
        for layer_index, layer in enumerate(self._layers):
            view = self._kv_views[layer_index]
            qkvs = [self._rms_norm(x, layer.attn_norm) @ layer.w_qkv for x in xs]
            attns = [
                self._decode_attention(view, qkv, position, block_table)
                for qkv, position, block_table in zip(qkvs, positions, block_tables, strict=True)
            ]
            xs = [x + attn @ layer.w_o for x, attn in zip(xs, attns, strict=True)]
            gate_ups = [self._rms_norm(x, layer.mlp_norm) @ layer.w_gate_up for x in xs]
            xs = [
                x + self._swiglu(gate_up) @ layer.w_down
                for x, gate_up in zip(xs, gate_ups, strict=True)
            ]
        next_tokens = [self._greedy(x) for x in xs]
        for seq, token in zip(seqs, next_tokens, strict=True):
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(token)
        return next_tokens

    def _decode_attention(
        self, view: np.ndarray, qkv: np.ndarray, position: int, block_table: np.ndarray
    ) -> np.ndarray:
        """Attention, one token of one sequence: ``qkv [(heads + 2 kv_heads) hd]`` -> ``[hidden]``.

        Writes the token's K/V at ``position`` through ``block_table``, then attends over
        positions [0, position] read back from the cache.
        """
        c = self.config
        qk = qkv[: self._k_end].reshape(c.num_heads + c.num_kv_heads, c.head_dim)
        qk = qk * self._rope_cos[position] + qk[:, self._rope_perm] * self._rope_sin[position]
        block_id = block_table[position // c.block_size_tokens]
        slot = position % c.block_size_tokens
        if slot == 0:  # a fresh block: clear stale bytes, so a block depends only on its tokens
            view[block_id] = 0
        view[block_id, 0, slot] = qk[c.num_heads :]
        view[block_id, 1, slot] = qkv[self._k_end :].reshape(c.num_kv_heads, c.head_dim)
        k_ctx, v_ctx = self._gather(view, block_table, position + 1)  # [ctx, kv_heads, hd]
        group = c.num_heads // c.num_kv_heads
        q = (qk[: c.num_heads] * self._attn_scale).reshape(c.num_kv_heads, group, c.head_dim)
        scores = q @ k_ctx.transpose(1, 2, 0)  # [kv_heads, group, ctx]
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        ctx = scores @ v_ctx.transpose(1, 0, 2)  # [kv_heads, group, hd]
        ctx /= scores.sum(axis=-1, keepdims=True)
        return ctx.reshape(c.hidden_size)

    # ------------------------------------------------------------------------------- shared math

    def _check_blocks(self, seq: Sequence, num_blocks_needed: int) -> None:
        if len(seq.block_ids) < num_blocks_needed:
            raise ValueError(
                f"sequence {seq.request_id} has {len(seq.block_ids)} KV blocks, "
                f"needs {num_blocks_needed}"
            )
        used = seq.block_ids[:num_blocks_needed]
        if min(used) < 0 or max(used) >= self.config.num_blocks:
            raise ValueError(
                f"sequence {seq.request_id} has block ids outside [0, {self.config.num_blocks})"
            )

    def _gather(
        self, view: np.ndarray, block_table: np.ndarray, num_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """K and V of logical tokens [0, num_tokens) read through the block table.

        ``block_table`` must cover exactly the blocks holding those tokens. Returns two
        ``[num_tokens, kv_heads, hd]`` arrays (copies: fancy indexing).
        """
        c = self.config
        k = view[block_table, 0].reshape(-1, c.num_kv_heads, c.head_dim)[:num_tokens]
        v = view[block_table, 1].reshape(-1, c.num_kv_heads, c.head_dim)[:num_tokens]
        return k, v

    def _rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm over the last axis of ``x [..., hidden]``."""
        mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
        return x * (1.0 / np.sqrt(mean_square + self._eps)) * weight

    @staticmethod
    def _swiglu(gate_up: np.ndarray) -> np.ndarray:
        """``silu(gate) * up`` for ``gate_up [..., 2 * intermediate]`` (gate first).

        ``silu(g) = g * sigmoid(g) = (g / 2) * (1 + tanh(g / 2))``: the tanh form cannot overflow.
        """
        half = gate_up.shape[-1] // 2
        gate_half = gate_up[..., :half] * _F32(0.5)
        act = np.tanh(gate_half)
        act += _F32(1.0)
        act *= gate_half
        act *= gate_up[..., half:]
        return act

    def _greedy(self, x: np.ndarray) -> int:
        """Argmax token of the final hidden state ``x [hidden]``."""
        logits = self._rms_norm(x, self._final_norm) @ self._lm_head
        return int(np.argmax(logits))
