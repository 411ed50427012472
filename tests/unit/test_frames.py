"""The KV wire format: round trips, and a strict decoder that refuses every malformed header."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.types import FencingToken
from pdserve.worker.transports.frames import (
    FLAG_BLOCK_IDS_U64,
    FLAG_NO_ACK,
    HEADER_NBYTES,
    DonePayload,
    ErrorPayload,
    FrameError,
    FrameHeader,
    FrameLimits,
    FrameType,
    HelloPayload,
    decode_block_ids,
    decode_header,
    encode_frame,
    encode_header,
    layer_frame_prefix,
)

LIMITS = FrameLimits(block_nbytes=4096, num_blocks=1000, max_block_ids=64)
TOKEN = FencingToken.new()


def _header_of(frame: bytes) -> FrameHeader:
    return decode_header(frame[:HEADER_NBYTES], LIMITS)


def test_layer_prefix_round_trip() -> None:
    ids = np.array([5, 999, 0, 17], dtype=np.int64)
    prefix = layer_frame_prefix(TOKEN, 3, ids, LIMITS.block_nbytes)
    header = _header_of(prefix)
    assert header == FrameHeader(FrameType.LAYER, TOKEN, 3, 4, 4 * 4096, 0)
    assert len(prefix) == HEADER_NBYTES + header.block_ids_nbytes
    decoded = decode_block_ids(header, prefix[HEADER_NBYTES:], LIMITS)
    assert decoded.tolist() == ids.tolist()


def test_large_block_ids_use_uint64() -> None:
    limits = FrameLimits(block_nbytes=8, num_blocks=2**40)
    ids = np.array([2**33, 1], dtype=np.int64)
    prefix = layer_frame_prefix(TOKEN, 0, ids, 8)
    header = decode_header(prefix[:HEADER_NBYTES], limits)
    assert header.flags & FLAG_BLOCK_IDS_U64
    assert header.block_id_nbytes == 8
    assert decode_block_ids(header, prefix[HEADER_NBYTES:], limits).tolist() == [2**33, 1]


def test_control_frames_round_trip() -> None:
    hello = HelloPayload(num_layers=32, block_size_tokens=16, block_nbytes=4096)
    frame = encode_frame(FrameType.HELLO, TOKEN, block_ids=[1, 2], payload=hello.encode())
    header = _header_of(frame)
    assert (header.frame_type, header.token, header.num_block_ids) == (FrameType.HELLO, TOKEN, 2)
    assert HelloPayload.decode(frame[HEADER_NBYTES + header.block_ids_nbytes :]) == hello

    done = DonePayload(first_token_id=-1, prefill_compute_s=0.25, num_layers=32)
    frame = encode_frame(FrameType.DONE, FencingToken(TOKEN.ticket_id, 7), payload=done.encode())
    assert _header_of(frame).token == FencingToken(TOKEN.ticket_id, 7)
    assert DonePayload.decode(frame[HEADER_NBYTES:]) == done

    error = ErrorPayload(int(FrameType.LAYER), "foreign_blocks", "blocks [3]")
    frame = encode_frame(FrameType.ERROR, None, layer=5, payload=error.encode())
    header = _header_of(frame)
    assert header.token is None and header.layer == 5
    assert ErrorPayload.decode(frame[HEADER_NBYTES:]) == error


def _valid_layer_header(**overrides: object) -> bytes:
    fields = dict(
        magic=b"PDKV", version=1, frame_type=2, flags=0, ticket=bytes(range(16)), attempt=1,
        layer=0, num_ids=2, payload=2 * LIMITS.block_nbytes,
    )
    fields.update(overrides)
    return struct.pack("<4sBBH16sIIIQ", *fields.values())


def test_hand_built_header_is_accepted() -> None:
    header = decode_header(_valid_layer_header(), LIMITS)
    assert header.frame_type is FrameType.LAYER and header.payload_nbytes == 8192


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"magic": b"PDKW"}, "magic"),
        ({"version": 4}, "version"),
        ({"version": 0}, "version"),
        ({"frame_type": 0}, "frame type"),
        ({"frame_type": 8}, "frame type"),
        ({"flags": 0x2}, "flags"),
        ({"attempt": 0}, "attempt 0"),
        ({"num_ids": 0, "payload": 0}, "names 0 blocks"),
        ({"num_ids": 65, "payload": 65 * 4096}, "names 65 blocks"),
        ({"payload": 2 * 4096 - 1}, "payload"),
        ({"payload": 2 * 4096 + 1}, "payload"),
        ({"payload": 2**64 - 1}, "payload"),
    ],
)
def test_malformed_layer_headers_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(FrameError, match=message):
        decode_header(_valid_layer_header(**overrides), LIMITS)


@pytest.mark.parametrize(
    ("frame_type", "overrides"),
    [
        (FrameType.DONE, {"num_ids": 1, "payload": 20}),  # DONE names no blocks
        (FrameType.DONE, {"num_ids": 0, "payload": 19}),  # DONE payload is fixed
        (FrameType.HELLO, {"num_ids": 1, "payload": 17}),  # HELLO payload is fixed
        (FrameType.ACK, {"num_ids": 0, "payload": 0}),  # ACK names what it answers
        (FrameType.ERROR, {"num_ids": 0, "payload": 0}),
        (FrameType.ABORT, {"num_ids": 0, "payload": 65 * 1024}),  # reason too long
        (FrameType.ABORT, {"num_ids": 0, "payload": 3, "layer": 1}),  # layer only in LAYER
    ],
)
def test_malformed_control_headers_are_refused(
    frame_type: FrameType, overrides: dict[str, object]
) -> None:
    with pytest.raises(FrameError):
        decode_header(_valid_layer_header(frame_type=int(frame_type), **overrides), LIMITS)


def test_frame_size_limit() -> None:
    limits = FrameLimits(block_nbytes=4096, num_blocks=1000, max_frame_nbytes=3 * 4096)
    with pytest.raises(FrameError, match="frame of"):
        decode_header(_valid_layer_header(num_ids=3, payload=3 * 4096), limits)
    decode_header(_valid_layer_header(num_ids=2, payload=2 * 4096), limits)


def test_wrong_header_length_is_refused() -> None:
    with pytest.raises(FrameError):
        decode_header(_valid_layer_header()[:-1], LIMITS)
    with pytest.raises(FrameError):
        decode_header(_valid_layer_header() + b"\0", LIMITS)


def test_block_ids_out_of_range_or_repeated_are_refused() -> None:
    header = FrameHeader(FrameType.LAYER, TOKEN, 0, 2, 2 * 4096, 0)
    with pytest.raises(FrameError, match=">="):
        decode_block_ids(header, np.array([1, 1000], "<u4").tobytes(), LIMITS)
    with pytest.raises(FrameError, match="repeat"):
        decode_block_ids(header, np.array([4, 4], "<u4").tobytes(), LIMITS)
    with pytest.raises(FrameError):
        decode_block_ids(header, np.array([4], "<u4").tobytes(), LIMITS)


def test_reply_without_ticket_has_no_token_but_requests_need_one() -> None:
    nil = dict(ticket=bytes(16), attempt=0, num_ids=0, payload=1)
    assert decode_header(_valid_layer_header(frame_type=5, **nil), LIMITS).token is None
    with pytest.raises(FrameError):
        decode_header(_valid_layer_header(frame_type=3, **{**nil, "payload": 20}), LIMITS)


def test_encoder_refuses_tokens_that_cannot_go_on_the_wire() -> None:
    with pytest.raises(FrameError):
        encode_header(FrameHeader(FrameType.ABORT, FencingToken("not-a-uuid", 1)))
    with pytest.raises(FrameError):
        encode_header(FrameHeader(FrameType.ABORT, FencingToken(TOKEN.ticket_id, 0)))


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=HEADER_NBYTES, max_size=HEADER_NBYTES))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        header = decode_header(data, LIMITS)
    except FrameError:
        return
    assert header.frame_nbytes <= LIMITS.max_frame_nbytes  # accepted means within limits


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, HEADER_NBYTES - 1),
    st.integers(0, 255),
    st.sampled_from(list(FrameType)),
)
def test_mutated_valid_headers_are_refused_or_well_formed(
    position: int, value: int, frame_type: FrameType
) -> None:
    frame = encode_frame(frame_type, TOKEN, payload=b"\x02") if frame_type in (
        FrameType.ACK, FrameType.ERROR, FrameType.ABORT
    ) else layer_frame_prefix(TOKEN, 1, np.array([1, 2]), LIMITS.block_nbytes)
    mutated = bytearray(frame[:HEADER_NBYTES])
    mutated[position] = value
    try:
        header = decode_header(bytes(mutated), LIMITS)
    except FrameError:
        return
    if header.frame_type is FrameType.LAYER:
        assert header.payload_nbytes == header.num_block_ids * LIMITS.block_nbytes
        assert 1 <= header.num_block_ids <= LIMITS.max_block_ids
    if header.frame_type is FrameType.LAYERS:
        num_layers = header.num_layers(LIMITS.block_nbytes)
        assert num_layers >= 1 and header.layer + num_layers <= LIMITS.num_layers
        assert header.payload_nbytes == num_layers * header.num_block_ids * LIMITS.block_nbytes
    assert not header.flags & FLAG_NO_ACK or header.frame_type is FrameType.HELLO
    assert header.token is not None or header.frame_type in (FrameType.ACK, FrameType.ERROR)


# ---- LAYERS frames and the NO_ACK flag -----------------------------------------------------------

LAYERS_LIMITS = FrameLimits(block_nbytes=4096, num_blocks=1000, max_block_ids=64, num_layers=8)


def test_layers_prefix_round_trip() -> None:
    ids = np.array([5, 999, 0], dtype=np.int64)
    prefix = layer_frame_prefix(TOKEN, 2, ids, LAYERS_LIMITS.block_nbytes, num_layers=4)
    header = decode_header(prefix[:HEADER_NBYTES], LAYERS_LIMITS)
    assert (header.frame_type, header.layer, header.num_block_ids) == (FrameType.LAYERS, 2, 3)
    assert header.payload_nbytes == 4 * 3 * 4096
    assert header.num_layers(LAYERS_LIMITS.block_nbytes) == 4
    assert decode_block_ids(header, prefix[HEADER_NBYTES:], LAYERS_LIMITS).tolist() == [5, 999, 0]
    # One layer is a plain LAYER frame, as before LAYERS existed.
    single = decode_header(layer_frame_prefix(TOKEN, 2, ids, 4096)[:HEADER_NBYTES], LAYERS_LIMITS)
    assert single.frame_type is FrameType.LAYER and single.num_layers(4096) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"payload": 2 * 4096 * 3 + 1}, "not a multiple"),  # not whole layers
        ({"payload": 0}, "not a multiple"),  # no layer at all
        ({"layer": 6, "payload": 2 * 4096 * 3}, "past layer 7"),  # layers 6..8 of 8
        ({"num_ids": 0, "payload": 0}, "names 0 blocks"),
        ({"flags": FLAG_NO_ACK, "payload": 2 * 4096 * 2}, "flags"),  # NO_ACK is HELLO's only
    ],
)
def test_malformed_layers_headers_are_refused(overrides: dict[str, object], message: str) -> None:
    fields = {"frame_type": int(FrameType.LAYERS), **overrides}
    with pytest.raises(FrameError, match=message):
        decode_header(_valid_layer_header(**fields), LAYERS_LIMITS)


def test_layers_ending_at_the_last_layer_are_accepted() -> None:
    header = decode_header(_valid_layer_header(frame_type=int(FrameType.LAYERS), layer=5,
                                               payload=2 * 4096 * 3), LAYERS_LIMITS)
    assert header.num_layers(4096) == 3


def test_no_ack_is_a_hello_flag() -> None:
    hello = HelloPayload(num_layers=8, block_size_tokens=16, block_nbytes=4096).encode()
    frame = encode_frame(FrameType.HELLO, TOKEN, block_ids=[3, 4], payload=hello,
                         flags=FLAG_NO_ACK)
    assert _header_of(frame).flags == FLAG_NO_ACK
    for frame_type, payload in ((FrameType.DONE, DonePayload(1, 0.0, 8).encode()),
                                (FrameType.ABORT, b"why")):
        with pytest.raises(FrameError, match="flags"):
            _header_of(encode_frame(frame_type, TOKEN, payload=payload, flags=FLAG_NO_ACK))
