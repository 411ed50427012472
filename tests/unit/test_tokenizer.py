"""The package tokenizer: byte round trips, specials, chat template, block hashes, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common import hf_tokenizer
from pdserve.common import tokenizer as tk
from pdserve.common.errors import ConfigError, InvalidArgumentError

# Any text that can be UTF-8 encoded (no lone surrogates).
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
_SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld — naïve café",
    "日本語のテキスト",
    "emoji 🙂👍🏽 and flags 🇫🇷",
    "e\u0301 combining",
    "special inside <|eos|> text <|bos|><|pad|> and a fake <|eox|> one",
    "<|eo",
    "x" * 3000,
]


@pytest.mark.parametrize("text", _SAMPLES)
def test_round_trip(text: str) -> None:
    assert tk.decode(tk.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", [s for s in _SAMPLES if "<|" not in s])
def test_plain_text_is_its_utf8_bytes(text: str) -> None:
    token_ids = tk.encode(text)
    assert token_ids == list(text.encode("utf-8"))
    assert tk.count(text) == len(token_ids)
    assert tk.decode(token_ids) == text


@given(_TEXT)
@settings(max_examples=200, deadline=None)
def test_round_trip_property(text: str) -> None:
    token_ids = tk.encode(text)
    assert all(0 <= t < tk.VOCAB_SIZE for t in token_ids)
    assert tk.count(text) == len(token_ids)
    assert tk.decode(token_ids, skip_special_tokens=False) == text


def test_empty() -> None:
    assert tk.encode("") == []
    assert tk.count("") == 0
    assert tk.decode([]) == ""


def test_special_ids_are_distinct_and_above_bytes() -> None:
    ids = {tk.BOS_ID, tk.EOS_ID, tk.PAD_ID}
    assert len(ids) == 3
    assert min(ids) >= tk.NUM_BYTE_TOKENS
    assert max(ids) < tk.VOCAB_SIZE
    assert tk.VOCAB_SIZE == tk.NUM_BYTE_TOKENS + len(ids)


def test_specials_in_text_become_ids() -> None:
    token_ids = tk.encode(f"a{tk.EOS_TOKEN}b{tk.BOS_TOKEN}{tk.PAD_TOKEN}")
    assert token_ids == [ord("a"), tk.EOS_ID, ord("b"), tk.BOS_ID, tk.PAD_ID]
    assert tk.count(f"a{tk.EOS_TOKEN}b") == 3
    # A string that only looks like a special stays bytes.
    assert tk.encode("<|eox|>") == list(b"<|eox|>")


def test_decode_skips_specials_by_default() -> None:
    token_ids = [tk.BOS_ID, *b"hi", tk.EOS_ID]
    assert tk.decode(token_ids) == "hi"
    assert tk.decode(token_ids, skip_special_tokens=False) == "<|bos|>hi<|eos|>"


def test_partial_utf8_is_replaced() -> None:
    token_ids = tk.encode("é🙂")
    assert tk.decode(token_ids[:1]) == "\ufffd"
    assert tk.decode(token_ids[:3]).startswith("é")
    assert "\ufffd" in tk.decode(token_ids[:3])
    # A skipped special between the two bytes of one character does not split it.
    assert tk.decode([token_ids[0], tk.EOS_ID, token_ids[1]]) == "é"


def test_decode_rejects_ids_outside_vocab() -> None:
    with pytest.raises(InvalidArgumentError):
        tk.decode([tk.VOCAB_SIZE])
    with pytest.raises(InvalidArgumentError):
        tk.decode([-1])


def test_chat_template_renders_turns_in_order() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
        },
        {"role": "assistant", "content": None},
    ]
    prompt = tk.render_chat_prompt(messages)
    assert prompt == (
        "<|bos|>system\nbe brief<|eos|>\n"
        "<|bos|>user\nhello<|eos|>\n"
        "<|bos|>assistant\n<|eos|>\n"
        "<|bos|>assistant\n"
    )
    token_ids = tk.encode(prompt)
    assert token_ids[0] == tk.BOS_ID
    assert token_ids.count(tk.BOS_ID) == 4
    assert token_ids.count(tk.EOS_ID) == 3
    without = tk.render_chat_prompt(messages, add_generation_prompt=False)
    assert prompt.startswith(without)
    assert not without.endswith("assistant\n")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "", "content": "x"}, "messages[0].role"),
        ({"role": "us\ner", "content": "x"}, "messages[0].role"),
        ({"content": "x"}, "messages[0].role"),
        ({"role": "user", "content": 3}, "messages[0].content"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
            "messages[0].content",
        ),
    ],
)
def test_chat_template_rejects_malformed(message: dict, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        tk.render_chat_prompt([message])
    assert info.value.field == field


def test_block_hashes_cover_full_blocks_only() -> None:
    token_ids = list(range(50))
    assert len(tk.prefix_block_hashes(token_ids, 16)) == 3
    assert tk.prefix_block_hashes(token_ids[:15], 16) == []
    hashes = tk.prefix_block_hashes(token_ids, 16)
    assert tk.prefix_block_hashes(token_ids[:48], 16) == hashes
    assert all(0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == len(hashes)


def test_block_hashes_equal_prefixes_share_leading_hashes() -> None:
    common = tk.encode("the same system prompt, long enough to fill a few blocks of tokens")
    a = tk.prefix_block_hashes(common + tk.encode(" and then question A"), 8)
    b = tk.prefix_block_hashes(common + tk.encode(" but question B instead"), 8)
    num_common_blocks = len(common) // 8
    assert a[:num_common_blocks] == b[:num_common_blocks]
    assert a[num_common_blocks:] != b[num_common_blocks:]


@pytest.mark.parametrize("changed_block", [0, 2, 5])
def test_block_hashes_change_from_the_changed_block_on(changed_block: int) -> None:
    block_size = 4
    token_ids = list(range(100, 100 + 6 * block_size))
    changed = list(token_ids)
    changed[changed_block * block_size + 1] += 1
    before = tk.prefix_block_hashes(token_ids, block_size)
    after = tk.prefix_block_hashes(changed, block_size)
    assert before[:changed_block] == after[:changed_block]
    for i in range(changed_block, len(before)):
        assert before[i] != after[i]


def test_block_hashes_depend_on_position_not_just_content() -> None:
    block = [7, 7, 7, 7]
    hashes = tk.prefix_block_hashes(block * 3, 4)
    assert len(set(hashes)) == 3


def test_block_hashes_reject_bad_input() -> None:
    with pytest.raises(ValueError):
        tk.prefix_block_hashes([1, 2, 3], 0)
    with pytest.raises(ValueError):
        tk.prefix_block_hashes([1, -2, 3, 4], 2)


def test_block_hashes_are_stable_across_processes() -> None:
    token_ids = tk.encode("stable across processes, whatever PYTHONHASHSEED says" * 3)
    code = (
        "import json, sys; from pdserve.common.tokenizer import prefix_block_hashes as h; "
        "print(json.dumps(h(json.loads(sys.argv[1]), 16)))"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps(token_ids)],
            env=env, capture_output=True, text=True, check=True, timeout=60,
        )
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == tk.prefix_block_hashes(token_ids, 16)


def test_export_writes_hf_folder(tmp_path: Path) -> None:
    out = tk.export(tmp_path / "tok", model_max_length=4096)
    tokenizer_json = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    special_map = json.loads((out / "special_tokens_map.json").read_text(encoding="utf-8"))
    vocab = tokenizer_json["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(tk.VOCAB_SIZE))
    assert {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]} == dict(
        tk.SPECIAL_TOKEN_TO_ID
    )
    assert config["eos_token"] == special_map["eos_token"] == tk.EOS_TOKEN
    assert config["model_max_length"] == 4096
    assert config["clean_up_tokenization_spaces"] is False


def test_exported_chat_template_matches_render(tmp_path: Path) -> None:
    jinja2 = pytest.importorskip("jinja2")
    tk.export(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"}]
    template = jinja2.Environment().from_string(config["chat_template"])
    for add in (True, False):
        rendered = template.render(messages=messages, add_generation_prompt=add)
        assert rendered == tk.render_chat_prompt(messages, add_generation_prompt=add)


def test_exported_tokenizer_gives_the_same_ids(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tk.export(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size(with_added_tokens=True) == tk.VOCAB_SIZE
    chat = tk.render_chat_prompt([{"role": "user", "content": "hi 🙂"}])
    for text in [*_SAMPLES, chat]:
        token_ids = tk.encode(text)
        assert hf.encode(text).ids == token_ids, text
        assert hf.decode(token_ids) == tk.decode(token_ids)
        assert hf.decode(token_ids, skip_special_tokens=False) == tk.decode(
            token_ids, skip_special_tokens=False
        )


@given(_TEXT)
@settings(max_examples=100, deadline=None)
def test_exported_tokenizer_same_ids_property(text: str) -> None:
    hf = _exported_hf_tokenizer()
    assert hf.encode(text).ids == tk.encode(text)


_HF_CACHE: dict[str, object] = {}


def _exported_hf_tokenizer():  # type: ignore[no-untyped-def]
    tokenizers = pytest.importorskip("tokenizers")
    if "hf" not in _HF_CACHE:
        _HF_CACHE["hf"] = tokenizers.Tokenizer.from_str(json.dumps(tk.hf_tokenizer_json()))
    return _HF_CACHE["hf"]


def test_exported_folder_loads_as_a_model_tokenizer(tmp_path: Path) -> None:
    tk.export(tmp_path)
    loaded = hf_tokenizer.load(tmp_path)
    assert isinstance(loaded, tk.Tokenizer)
    assert loaded.vocab_size == tk.VOCAB_SIZE
    assert loaded.eos_token_id == tk.EOS_ID
    assert loaded.bos_token_id == tk.BOS_ID
    text = "load me <|eos|> 🙂"
    assert loaded.encode(text) == tk.encode(text)
    assert loaded.count(text) == tk.count(text)
    assert loaded.decode(tk.encode(text)) == tk.decode(tk.encode(text))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"}]
    assert loaded.render_chat(messages) == tk.render_chat_prompt(messages)


def test_load_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope"):
        hf_tokenizer.load(tmp_path / "nope")


def test_byte_stream_releases_whole_characters() -> None:
    text = "é🙂 <|eos|>x"
    stream = tk.DEFAULT_TOKENIZER.decode_stream()
    pieces = [stream.push([token_id]) for token_id in tk.encode(text)]
    pieces.append(stream.finish())
    assert "".join(pieces) == tk.decode(tk.encode(text))
    assert [p for p in pieces if p] == ["é", "🙂", " ", "x"]
    truncated = tk.DEFAULT_TOKENIZER.decode_stream()
    assert truncated.push(tk.encode("🙂")[:2]) == ""
    assert truncated.finish() == "\ufffd"


def test_byte_tokenizer_satisfies_protocol() -> None:
    assert isinstance(tk.DEFAULT_TOKENIZER, tk.Tokenizer)
