"""The tokenizer bundle a worker ships: its digest, its size cap, its wire form and what it takes
from a model folder."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from helpers.tokenizers import CHATML_TEMPLATE, IM_END, PAD, build_tokenizer_folder

from pdserve.api.v1 import common_pb2 as pb
from pdserve.common.errors import ConfigError, InvalidArgumentError
from pdserve.common.tokenizer_bundle import (
    MAX_BUNDLE_BYTES,
    TokenizerBundle,
    bundle_from_folder,
    bundle_from_pb,
    bundle_to_pb,
)

BUNDLE = TokenizerBundle(b'{"model": {}}', "{{ messages }}", "<s>", "</s>", "<pad>", 8192)


def test_digest_is_the_documented_canonical_sha256() -> None:
    digest = hashlib.sha256(b"pdserve-tokenizer-bundle-v1\n")
    for value in (b'{"model": {}}', b"{{ messages }}", b"<s>", b"</s>", b"<pad>", b"8192"):
        digest.update(len(value).to_bytes(8, "little") + value)
    assert BUNDLE.sha256 == digest.hexdigest()


@pytest.mark.parametrize("change", [
    {"tokenizer_json": b'{"model": {} }'}, {"chat_template": ""}, {"bos_token": ""},
    {"eos_token": "<s>"}, {"pad_token": "</s>"}, {"max_model_len": 8193},
    # Moving text from one field to the next must change the digest too (lengths are hashed).
    {"bos_token": "<s></s>", "eos_token": ""},
])
def test_every_field_is_in_the_digest(change: dict) -> None:
    changed = dataclasses.replace(BUNDLE, **change)
    assert changed.sha256 != BUNDLE.sha256
    assert changed != BUNDLE


def test_equal_content_equal_digest() -> None:
    again = TokenizerBundle(b'{"model": {}}', "{{ messages }}", "<s>", "</s>", "<pad>", 8192)
    assert again == BUNDLE and again.sha256 == BUNDLE.sha256


def test_size_cap() -> None:
    TokenizerBundle(b"x" * (MAX_BUNDLE_BYTES - 3), "abc")
    with pytest.raises(InvalidArgumentError) as info:
        TokenizerBundle(b"x" * (MAX_BUNDLE_BYTES - 3), "abcd")
    assert info.value.field == "tokenizer"
    assert str(MAX_BUNDLE_BYTES) in info.value.message


def test_wire_round_trip() -> None:
    message = bundle_to_pb(BUNDLE)
    assert message.sha256 == BUNDLE.sha256
    decoded = bundle_from_pb(pb.TokenizerBundle.FromString(message.SerializeToString()))
    assert decoded == BUNDLE and decoded.sha256 == BUNDLE.sha256


@pytest.mark.parametrize(("change", "field"), [
    ({"sha256": "0" * 64}, "tokenizer.sha256"),
    ({"sha256": ""}, "tokenizer.sha256"),
    ({"max_model_len": 1}, "tokenizer.sha256"),  # content changed after the digest was taken
    ({"tokenizer_json": b""}, "tokenizer.tokenizer_json"),
    ({"tokenizer_json": b"\xff\xfe not utf-8"}, "tokenizer.tokenizer_json"),
])
def test_bad_wire_bundles_name_the_field(change: dict, field: str) -> None:
    message = bundle_to_pb(BUNDLE)
    for name, value in change.items():
        setattr(message, name, value)
    with pytest.raises(InvalidArgumentError) as info:
        bundle_from_pb(message)
    assert info.value.field == field


def test_from_a_tokenizer_folder(tmp_path: Path) -> None:
    folder = build_tokenizer_folder(tmp_path, max_model_len=777)
    bundle = bundle_from_folder(folder)
    assert bundle.tokenizer_json == (folder / "tokenizer.json").read_bytes()
    assert (bundle.chat_template, bundle.bos_token, bundle.eos_token, bundle.pad_token) == (
        CHATML_TEMPLATE, "", IM_END, PAD)
    assert bundle.max_model_len == 777
    assert bundle_from_folder(folder) == bundle  # deterministic


def test_model_folder_files_that_win(tmp_path: Path) -> None:
    folder = build_tokenizer_folder(tmp_path, max_model_len=777)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["bos_token"] = {"content": "<|im_start|>", "special": True}
    config["model_max_length"] = int(1e30)  # transformers' "no limit"
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "D"}]
    config_path.write_text(json.dumps(config))
    bundle = bundle_from_folder(folder)
    assert (bundle.bos_token, bundle.max_model_len, bundle.chat_template) == (
        "<|im_start|>", 0, "D")
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (folder / "chat_template.jinja").write_text("J", encoding="utf-8")
    bundle = bundle_from_folder(folder)
    assert (bundle.max_model_len, bundle.chat_template) == (2048, "J")


def test_bad_folders_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a folder"):
        bundle_from_folder(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no tokenizer.json") as info:
        bundle_from_folder(tmp_path)
    assert str(tmp_path) in info.value.message and info.value.field == "tokenizer_path"
    folder = build_tokenizer_folder(tmp_path / "tok")
    (folder / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="tokenizer_config.json"):
        bundle_from_folder(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ConfigError, match="chat_template"):
        bundle_from_folder(folder)
