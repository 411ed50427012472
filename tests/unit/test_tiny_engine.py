"""The ``tiny`` engine: streaming prefill, paged KV, transfer equivalence, batch invariance.

Most tests use a small config (fast); a few run the default one. Equality of tokens is exact:
the point of the engine is that disaggregated output equals colocated output token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pdserve.common import tokenizer as tk
from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.engine import Engine, Sequence
from pdserve.worker.engines.tiny import TinyConfig, TinyEngine, kv_block_checksum

NUM_DECODE_STEPS = 8
KV_SHAPES = {"gqa": (4, 2), "mha": (4, 4)}  # (num_heads, num_kv_heads)
BLOCK_SIZES = [4, 16, 32]
PROMPT_LENGTHS = [1, 37, 300]


def small_config(**overrides: object) -> TinyConfig:
    values: dict[str, object] = dict(
        num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
        block_size_tokens=4, num_blocks=256, max_context_tokens=1024, seed=7,
    )
    values.update(overrides)
    return TinyConfig(**values)  # type: ignore[arg-type]


def make_prompt(num_tokens: int, seed: int = 0) -> list[int]:
    text = tk.encode("The quick brown fox jumps over the lazy dog; pack my box with jugs. ")
    rng = np.random.default_rng(seed)
    start = int(rng.integers(0, len(text)))
    return [text[(start + i) % len(text)] for i in range(num_tokens)]


def new_sequence(
    engine: TinyEngine, prompt: list[int], block_ids: list[int], max_tokens: int = NUM_DECODE_STEPS
) -> Sequence:
    assert len(block_ids) >= engine.layout.num_blocks_for(len(prompt) + max_tokens)
    return Sequence(request_id=f"r{len(prompt)}", prompt_token_ids=prompt, max_tokens=max_tokens,
                    block_ids=block_ids)


def generate(engine: TinyEngine, seq: Sequence) -> list[int]:
    """Prefill, then decode alone until ``max_tokens``; returns the output tokens."""
    for _ in engine.prefill_layers(seq):
        pass
    while not seq.is_finished:
        engine.decode_step([seq])
    return list(seq.output_token_ids)


def logical_kv(engine: TinyEngine, seq: Sequence, layer: int) -> np.ndarray:
    """The sequence's K/V of one layer in logical block order: ``[blocks, 2, block, kv, hd]``."""
    num_blocks = engine.layout.num_blocks_for(seq.num_computed_tokens)
    return engine.kv_view(layer)[seq.block_ids[:num_blocks]]


def fill_with_noise(engine: TinyEngine, seed: int) -> None:
    """Stale data everywhere, so reading any block outside the table would change the output."""
    rng = np.random.default_rng(seed)
    for layer in range(engine.layout.num_layers):
        view = engine.kv_view(layer)
        view[...] = rng.standard_normal(view.shape, dtype=np.float32)


def transfer_prefill(
    source: TinyEngine,
    source_seq: Sequence,
    dest: TinyEngine,
    dest_block_ids: list[int],
    tamper: Callable[[int, int, memoryview], None] | None = None,
) -> Sequence:
    """Prefill on ``source``, shipping each layer's prompt blocks into ``dest`` as it is yielded.

    Copies go through ``KvCache.block_view`` (bytes only), the way a transport writes them, and
    each copied block's checksum is compared with the source's. Returns the destination's
    sequence, set up as the decode worker would after the transfer.
    """
    num_blocks = source.layout.num_blocks_for(len(source_seq.prompt_token_ids))
    layers_seen = []
    for layer in source.prefill_layers(source_seq):
        layers_seen.append(layer)
        for logical in range(num_blocks):
            src_id, dst_id = source_seq.block_ids[logical], dest_block_ids[logical]
            frame = dest.kv_cache.block_view(layer, dst_id)
            frame[:] = source.kv_cache.block_view(layer, src_id)
            assert dest.block_checksum(layer, dst_id) == source.block_checksum(layer, src_id)
            if tamper is not None:
                tamper(layer, logical, frame)
    assert layers_seen == list(range(source.layout.num_layers))
    return Sequence(
        request_id=source_seq.request_id,
        prompt_token_ids=list(source_seq.prompt_token_ids),
        max_tokens=source_seq.max_tokens,
        block_ids=dest_block_ids,
        num_computed_tokens=len(source_seq.prompt_token_ids),
        output_token_ids=list(source_seq.output_token_ids),
    )


# ------------------------------------------------------------------------------ layout and cache


def test_layout_matches_config() -> None:
    engine = TinyEngine(small_config(block_size_tokens=16, num_kv_heads=2))
    c = engine.config
    assert engine.layout.num_layers == c.num_layers
    assert engine.layout.num_blocks == c.num_blocks
    assert engine.layout.block_size_tokens == 16
    assert engine.layout.block_nbytes == 2 * 16 * c.num_kv_heads * c.head_dim * 4
    assert engine.kv_cache.layer_buffers[0].shape == (c.num_blocks, engine.layout.block_nbytes)


def test_default_config() -> None:
    c = TinyConfig()
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (8, 256, 8, 2)
    assert c.head_dim == 32
    assert c.block_size_tokens == 16
    assert c.vocab_size == tk.VOCAB_SIZE
    # Room for a few 4K-token sequences.
    assert c.num_blocks * c.block_size_tokens >= 3 * 4096


def test_engine_satisfies_protocol() -> None:
    engine = TinyEngine(small_config())
    assert isinstance(engine, Engine)
    assert engine.name == "tiny"


def test_kv_view_aliases_the_byte_buffers() -> None:
    engine = TinyEngine(small_config())
    for layer in range(engine.layout.num_layers):
        view = engine.kv_view(layer)
        assert view.dtype == np.float32
        assert np.shares_memory(view, engine.kv_cache.layer_buffers[layer])
    engine.kv_view(1)[5, 1, 2, 0, 3] = 1.5
    raw = bytes(engine.kv_cache.block_view(1, 5))
    assert np.frombuffer(raw, dtype=np.float32).tolist().count(1.5) == 1
    assert not engine.kv_cache.layer_buffers[0].any()


def test_block_checksum() -> None:
    engine = TinyEngine(small_config())
    before = engine.block_checksum(0, 3)
    assert before == kv_block_checksum(bytes(engine.kv_cache.block_view(0, 3)))
    assert before == engine.block_checksum(1, 3)  # both all zeros
    engine.kv_cache.block_view(0, 3)[17] = 1
    assert engine.block_checksum(0, 3) != before
    assert engine.block_checksum(0, 3) == kv_block_checksum(engine.kv_cache.layer_buffers[0][3])


@pytest.mark.parametrize(
    "overrides",
    [dict(hidden_size=60, num_heads=8), dict(num_heads=4, num_kv_heads=3),
     dict(hidden_size=12, num_heads=4), dict(num_blocks=0)],
)
def test_config_rejects_bad_shapes(overrides: dict) -> None:
    with pytest.raises(ValueError):
        small_config(**overrides)


# -------------------------------------------------------------------------------------- prefill


def test_prefill_yields_layers_in_order_with_their_kv_in_place() -> None:
    engine = TinyEngine()  # default config: 8 layers
    prompt = make_prompt(45)
    seq = new_sequence(engine, prompt, list(range(10, 20)))
    prompt_blocks = seq.block_ids[: engine.layout.num_blocks_for(len(prompt))]
    layers = []
    for layer in engine.prefill_layers(seq):
        layers.append(layer)
        for other in range(engine.layout.num_layers):
            written = engine.kv_cache.layer_buffers[other][prompt_blocks].any(axis=1)
            assert written.all() if other <= layer else not written.any()
        assert seq.output_token_ids == []  # the first token comes after the last layer
    assert layers == list(range(8))
    assert seq.num_computed_tokens == len(prompt)
    assert len(seq.output_token_ids) == 1
    assert 0 <= seq.output_token_ids[0] < tk.VOCAB_SIZE
    # Nothing outside the prompt's blocks was touched.
    untouched = np.ones(engine.layout.num_blocks, dtype=bool)
    untouched[prompt_blocks] = False
    assert not engine.kv_cache.layer_buffers[0][untouched].any()


def test_prefill_zero_fills_the_tail_of_the_last_block() -> None:
    engine = TinyEngine(small_config(block_size_tokens=16))
    fill_with_noise(engine, seed=1)
    seq = new_sequence(engine, make_prompt(20), list(range(8)))
    for _ in engine.prefill_layers(seq):
        pass
    for layer in range(engine.layout.num_layers):
        last_block = engine.kv_view(layer)[seq.block_ids[1]]  # tokens 16..31, prompt ends at 19
        assert not last_block[:, 4:].any()
        assert last_block[:, :4].any()


def test_prefill_validates_input() -> None:
    engine = TinyEngine(small_config())
    with pytest.raises(InvalidArgumentError):
        engine.prefill_layers(Sequence("r", [], 4, block_ids=[0]))
    with pytest.raises(InvalidArgumentError):
        engine.prefill_layers(Sequence("r", [1, tk.VOCAB_SIZE], 4, block_ids=[0]))
    with pytest.raises(InvalidArgumentError):
        engine.prefill_layers(Sequence("r", [1] * 1025, 4, block_ids=list(range(257))))
    with pytest.raises(ValueError):
        engine.prefill_layers(Sequence("r", [1] * 9, 4, block_ids=[0, 1]))  # needs 3 blocks
    with pytest.raises(ValueError):
        engine.prefill_layers(Sequence("r", [1] * 4, 4, block_ids=[256]))
    seq = Sequence("r", [1, 2], 4, block_ids=[0, 1])
    for _ in engine.prefill_layers(seq):
        pass
    with pytest.raises(ValueError):
        engine.prefill_layers(seq)  # already prefilled


def test_decode_validates_input() -> None:
    engine = TinyEngine(small_config())
    not_prefilled = Sequence("r", [1, 2, 3], 4, block_ids=[0, 1])
    with pytest.raises(ValueError):
        engine.decode_step([not_prefilled])
    seq = Sequence("s", [1, 2, 3, 4], 4, block_ids=[2])
    for _ in engine.prefill_layers(seq):
        pass
    with pytest.raises(ValueError):
        engine.decode_step([seq])  # position 4 needs a second block
    seq.block_ids.append(3)
    assert len(engine.decode_step([seq])) == 1
    assert engine.decode_step([]) == []


# ----------------------------------------------------------------------------------- determinism


def test_same_seed_same_tokens_across_instances() -> None:
    prompt = make_prompt(120, seed=3)
    first, second = TinyEngine(), TinyEngine()
    assert first.weights_fingerprint == second.weights_fingerprint
    tokens = generate(first, new_sequence(first, prompt, list(range(0, 9))))
    assert tokens == generate(second, new_sequence(second, prompt, list(range(40, 49))))
    assert len(tokens) == NUM_DECODE_STEPS
    other = TinyEngine(TinyConfig(seed=1))
    assert other.weights_fingerprint != first.weights_fingerprint
    assert generate(other, new_sequence(other, prompt, list(range(9)))) != tokens


def test_output_depends_on_the_context() -> None:
    """Sanity of the random model: not a constant or a pure echo of the last token."""
    engine = TinyEngine(small_config())
    a = generate(engine, new_sequence(engine, make_prompt(30, seed=1), list(range(0, 12)), 16))
    b = generate(engine, new_sequence(engine, make_prompt(30, seed=2), list(range(12, 24)), 16))
    assert len(set(a)) >= 4
    assert a != b


@pytest.mark.parametrize("is_tied", [True, False])
def test_tied_and_separate_output_heads(is_tied: bool) -> None:
    prompt = make_prompt(25)
    engine = TinyEngine(small_config(has_tied_embeddings=is_tied))
    again = TinyEngine(small_config(has_tied_embeddings=is_tied))
    other = TinyEngine(small_config(has_tied_embeddings=not is_tied))
    tokens = generate(engine, new_sequence(engine, prompt, list(range(10))))
    assert tokens == generate(again, new_sequence(again, prompt, list(range(10))))
    assert engine.weights_fingerprint != other.weights_fingerprint


# --------------------------------------------------------------------------------- paged KV cache


@pytest.mark.parametrize("kv_shape", sorted(KV_SHAPES))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
def test_paged_equals_contiguous(kv_shape: str, block_size: int, prompt_len: int) -> None:
    num_heads, num_kv_heads = KV_SHAPES[kv_shape]
    config = small_config(num_heads=num_heads, num_kv_heads=num_kv_heads,
                          block_size_tokens=block_size)
    prompt = make_prompt(prompt_len, seed=prompt_len)
    contiguous = TinyEngine(config)
    paged = TinyEngine(config)
    fill_with_noise(paged, seed=2)
    num_blocks = contiguous.layout.num_blocks_for(prompt_len + NUM_DECODE_STEPS)
    identity = list(range(num_blocks))
    shuffled = [int(b) for b in np.random.default_rng(prompt_len).permutation(config.num_blocks)]
    shuffled = shuffled[:num_blocks]
    assert shuffled != identity
    seq_contiguous = new_sequence(contiguous, prompt, identity)
    seq_paged = new_sequence(paged, prompt, shuffled)
    assert generate(contiguous, seq_contiguous) == generate(paged, seq_paged)
    for layer in range(config.num_layers):
        assert np.array_equal(logical_kv(contiguous, seq_contiguous, layer),
                              logical_kv(paged, seq_paged, layer))


# ------------------------------------------------------------------------ transfer equivalence


@pytest.mark.parametrize("kv_shape", sorted(KV_SHAPES))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
def test_transferred_kv_decodes_like_colocated(
    kv_shape: str, block_size: int, prompt_len: int
) -> None:
    num_heads, num_kv_heads = KV_SHAPES[kv_shape]
    config = small_config(num_heads=num_heads, num_kv_heads=num_kv_heads,
                          block_size_tokens=block_size)
    prompt = make_prompt(prompt_len, seed=prompt_len + 1)
    prefill_engine, decode_engine = TinyEngine(config), TinyEngine(config)
    fill_with_noise(decode_engine, seed=3)
    num_blocks = prefill_engine.layout.num_blocks_for(prompt_len + NUM_DECODE_STEPS)
    source_blocks = list(range(num_blocks))
    dest_blocks = list(range(config.num_blocks - 1, config.num_blocks - 1 - num_blocks, -1))

    colocated = new_sequence(prefill_engine, prompt, source_blocks)
    received = transfer_prefill(prefill_engine, colocated, decode_engine, dest_blocks)
    while not colocated.is_finished:
        prefill_engine.decode_step([colocated])
    while not received.is_finished:
        decode_engine.decode_step([received])
    assert received.output_token_ids == colocated.output_token_ids
    assert len(received.output_token_ids) == NUM_DECODE_STEPS


def test_corrupted_transfer_changes_the_output() -> None:
    """Negative control: the equivalence above would notice one wrong block."""
    config = small_config()
    prompt = make_prompt(24, seed=5)
    reference_engine = TinyEngine(config)
    reference = generate(
        reference_engine, new_sequence(reference_engine, prompt, list(range(10)), max_tokens=16)
    )
    noise = np.random.default_rng(4).standard_normal(
        config.kv_block_nbytes // 4, dtype=np.float32
    )

    def tamper(layer: int, logical: int, frame: memoryview) -> None:
        if layer == 1 and logical == 2:
            frame[:] = noise.view(np.uint8)

    source, dest = TinyEngine(config), TinyEngine(config)
    received = transfer_prefill(source, new_sequence(source, prompt, list(range(10)), 16),
                                dest, list(range(100, 110)), tamper=tamper)
    assert dest.block_checksum(1, 102) != source.block_checksum(1, 2)
    while not received.is_finished:
        dest.decode_step([received])
    assert received.output_token_ids[0] == reference[0]  # computed by the source, unaffected
    assert received.output_token_ids != reference


# ---------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("kv_shape", sorted(KV_SHAPES))
def test_decode_is_batch_invariant(kv_shape: str) -> None:
    num_heads, num_kv_heads = KV_SHAPES[kv_shape]
    config = small_config(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size_tokens=16)
    max_tokens = 12
    prompt = make_prompt(70, seed=9)

    alone_engine = TinyEngine(config)
    alone = new_sequence(alone_engine, prompt, list(range(0, 6)), max_tokens)
    alone_tokens = generate(alone_engine, alone)

    engine = TinyEngine(config)
    target = new_sequence(engine, prompt, list(range(50, 56)), max_tokens)
    others = [new_sequence(engine, make_prompt(n, seed=n), list(range(10 * i, 10 * i + 10)),
                           max_tokens=30)
              for i, n in enumerate([5, 130, 33], start=1)]
    for seq in [target, *others]:
        for _ in engine.prefill_layers(seq):
            pass
    late = new_sequence(engine, make_prompt(60, seed=11), list(range(60, 70)), max_tokens=30)
    late_prefill = engine.prefill_layers(late)
    step = 0
    while not target.is_finished:
        batch = [seq for seq in others if not seq.is_finished]
        batch = batch[: 1 + step % 3]  # batch composition changes every step
        if step >= 3:
            # A prefill of another sequence interleaves with decode, one layer per step.
            if next(late_prefill, None) is None:
                batch.append(late)
        batch.insert(step % (len(batch) + 1), target)  # and so does the target's position
        engine.decode_step(batch)
        step += 1
    assert target.output_token_ids == alone_tokens
    for layer in range(config.num_layers):
        assert np.array_equal(logical_kv(engine, target, layer),
                              logical_kv(alone_engine, alone, layer))


def test_long_prompt_default_config() -> None:
    """The default engine on a few hundred tokens: transfer equivalence at full size."""
    prompt = make_prompt(333, seed=12)
    source, dest = TinyEngine(), TinyEngine()
    blocks = source.layout.num_blocks_for(len(prompt) + 4)
    colocated = new_sequence(source, prompt, list(range(blocks)), max_tokens=4)
    received = transfer_prefill(source, colocated, dest, list(range(500, 500 + blocks)))
    for _ in range(3):
        source.decode_step([colocated])
        dest.decode_step([received])
    assert received.output_token_ids == colocated.output_token_ids
