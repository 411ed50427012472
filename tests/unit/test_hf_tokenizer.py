"""A real model's tokenizer (``HfTokenizer``): counts as the ``tokenizers`` library counts, chat
templates rendered as Hugging Face's ``apply_chat_template`` renders them (expected strings
written out by hand from each template), and streamed text that never splits a character."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from helpers.tokenizers import CHATML_TEMPLATE, IM_END, IM_START, PAD, build_tokenizer_folder
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common import tokenizer as tk
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.hf_tokenizer import HfTokenizer, load
from pdserve.common.tokenizer_bundle import TokenizerBundle, bundle_from_folder

TEXTS = ["", "hello world", "The quick brown fox", "héllo wörld — naïve café", "日本語のテキスト",
         "emoji 🙂👍🏽 and flags 🇫🇷", "specials <|im_start|>inside<|im_end|> text", "x" * 500]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi 🙂"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_folder(tmp_path_factory.mktemp("tok"), max_model_len=512)


@pytest.fixture(scope="module")
def model(folder: Path) -> HfTokenizer:
    return load(folder)


@pytest.fixture(scope="module")
def library(folder: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def with_template(model_folder: Path, template: str, **specials: str) -> HfTokenizer:
    bundle = bundle_from_folder(model_folder)
    return HfTokenizer.from_bundle(TokenizerBundle(
        bundle.tokenizer_json, template, specials.get("bos_token", ""),
        specials.get("eos_token", ""), specials.get("pad_token", ""), bundle.max_model_len))


# -- ids and counts ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_counts_are_the_librarys(model: HfTokenizer, library: tokenizers.Tokenizer,
                                         text: str) -> None:
    ids = library.encode(text, add_special_tokens=False).ids
    assert model.encode(text) == ids
    assert model.count(text) == len(ids)
    assert model.decode(ids) == library.decode(ids)
    assert model.decode(ids, skip_special_tokens=False) == text


def test_specials_and_limits_come_from_the_folder(model: HfTokenizer,
                                                  library: tokenizers.Tokenizer) -> None:
    assert isinstance(model, tk.Tokenizer)
    assert model.vocab_size == library.get_vocab_size(with_added_tokens=True)
    assert (model.eos_token_id, model.bos_token_id) == (library.token_to_id(IM_END), None)
    assert model.pad_token_id == library.token_to_id(PAD)
    assert model.max_model_len == 512
    assert model.encode(f"{IM_START}user") == [library.token_to_id(IM_START),
                                               *library.encode("user").ids]


def test_raw_prompts_get_the_post_processors_specials(folder: Path, tmp_path: Path) -> None:
    library = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    start = library.token_to_id(IM_START)
    library.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{IM_START} $A", special_tokens=[(IM_START, start)])
    library.save(str(tmp_path / "tokenizer.json"))
    model = load(tmp_path)
    plain = library.encode("hello", add_special_tokens=False).ids
    assert model.encode("hello", add_special_tokens=True) == [start, *plain]
    assert model.encode("hello") == plain


# -- chat templates ---------------------------------------------------------------------------


def test_chatml_renders_turns_and_the_generation_prompt(model: HfTokenizer,
                                                        library: tokenizers.Tokenizer) -> None:
    prompt = model.render_chat(MESSAGES)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nhi 🙂<|im_end|>\n"
                      "<|im_start|>assistant\n")
    ids = model.encode(prompt)
    assert ids == library.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == library.token_to_id(IM_START)
    assert ids.count(library.token_to_id(IM_START)) == 3
    assert ids.count(library.token_to_id(IM_END)) == 2
    assert model.render_chat(MESSAGES, add_generation_prompt=False) == prompt.removesuffix(
        "<|im_start|>assistant\n")


def test_text_parts_are_joined_with_newlines_and_none_is_empty(model: HfTokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": []}]
    assert model.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n")


def test_special_token_variables(folder: Path) -> None:
    model = with_template(folder, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                  "{{ eos_token }}{% endfor %}", bos_token="<s>", eos_token="</s>")
    assert model.render_chat(MESSAGES) == "<s>Be brief.</s>hi 🙂</s>"


def test_blocks_are_trimmed_as_transformers_trims_them(folder: Path) -> None:
    """``trim_blocks`` drops the newline after a block tag, ``lstrip_blocks`` the indentation
    before one; the indentation before ``{{`` stays."""
    template = ("{% for message in messages %}\n"
                "    {% if message['role'] == 'user' %}\n"
                "    U: {{ message['content'] }}\n"
                "    {% endif %}\n"
                "{% endfor %}\n")
    assert with_template(folder, template).render_chat(MESSAGES) == "    U: hi 🙂\n"


def test_tojson_keeps_text_as_it_is(folder: Path) -> None:
    model = with_template(folder, "{{ messages | tojson }}")
    messages = [{"role": "user", "content": "<é & 'x'>"}]
    assert model.render_chat(messages) == '[{"role": "user", "content": "<é & \'x\'>"}]'


def test_loop_controls_and_the_generation_tag(folder: Path) -> None:
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}")
    assert with_template(folder, template).render_chat(MESSAGES) == "[Be brief.]"


def test_raise_exception_refuses_the_messages(folder: Path) -> None:
    model = with_template(folder, "{% if messages[0]['role'] != 'user' %}"
                                  "{{ raise_exception('Conversations must start with a user') }}"
                                  "{% endif %}ok")
    with pytest.raises(InvalidArgumentError, match="must start with a user") as info:
        model.render_chat(MESSAGES)
    assert info.value.field == "messages"
    assert model.render_chat(MESSAGES[1:]) == "ok"


def test_the_sandbox_keeps_templates_to_their_variables(folder: Path) -> None:
    model = with_template(folder, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgumentError) as info:
        model.render_chat(MESSAGES)
    assert info.value.field == "messages"


@pytest.mark.parametrize(("messages", "field"), [
    (["not an object"], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
     "messages[0].content"),
])
def test_malformed_messages_name_the_field(model: HfTokenizer, messages: list, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        model.render_chat(messages)
    assert info.value.field == field


def test_a_model_without_a_template_refuses_chat(folder: Path) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        with_template(folder, "").render_chat(MESSAGES)
    assert info.value.field == "messages"


def test_a_broken_template_is_refused_when_the_bundle_loads(folder: Path) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        with_template(folder, "{% for message in messages %}never closed")
    assert info.value.field == "tokenizer.chat_template"


def test_a_bundle_that_is_not_a_tokenizer_is_refused() -> None:
    for document in (b"{not json", json.dumps({"model": {"type": "Nonsense"}}).encode()):
        with pytest.raises(InvalidArgumentError) as info:
            HfTokenizer.from_bundle(TokenizerBundle(document, CHATML_TEMPLATE))
        assert info.value.field == "tokenizer.tokenizer_json"


# -- streamed text ----------------------------------------------------------------------------


def _byte_token_ids(library: tokenizers.Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet every such vocabulary has), so
    characters are split across tokens for sure."""
    byte_chars = tk._byte_to_unicode()
    ids = [library.token_to_id(byte_chars[b]) for b in text.encode("utf-8")]
    assert None not in ids
    return ids


def test_stream_releases_whole_characters_only(model: HfTokenizer,
                                               library: tokenizers.Tokenizer) -> None:
    text = "é🙂 日本 🇫🇷!"
    stream = model.decode_stream()
    pieces = [stream.push([token_id]) for token_id in _byte_token_ids(library, text)]
    pieces.append(stream.finish())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert [p for p in pieces if p][:2] == ["é", "🙂"]


def test_stream_ends_a_cut_character_as_a_replacement(model: HfTokenizer,
                                                      library: tokenizers.Tokenizer) -> None:
    stream = model.decode_stream()
    assert [stream.push([t]) for t in _byte_token_ids(library, "é🙂")[:4]] == ["", "é", "", ""]
    assert stream.finish() == "\ufffd"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab é日🙂\n", max_size=40),
       cuts=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=8),
       is_byte_tokens=st.booleans())
def test_streamed_text_is_the_decoded_text_whatever_the_chunks(
    model: HfTokenizer, library: tokenizers.Tokenizer, text: str, cuts: list[int],
    is_byte_tokens: bool,
) -> None:
    ids = _byte_token_ids(library, text) if is_byte_tokens else model.encode(text)
    stream = model.decode_stream()
    pieces, position, index = [], 0, 0
    while position < len(ids):
        size = cuts[index % len(cuts)]
        pieces.append(stream.push(ids[position:position + size]))
        position, index = position + size, index + 1
    pieces.append(stream.finish())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
