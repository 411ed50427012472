"""Tokenizers for tests: a real Hugging Face tokenizer folder built in-process (a small byte-level
BPE trained here, no downloads) with a ChatML chat template, and a tokenizer source that gives one
tokenizer for every model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.common.tokenizer import Tokenizer as PdserveTokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen and SmolLM2 use it: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message
and ``<|im_start|>assistant\\n`` to prompt a reply."""
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Disaggregated serving splits prefill and "
    "decode onto separate pools of GPUs; the KV cache moves from one to the other. "
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🙂👍🏽 and flags 🇫🇷. "
)


def build_tokenizer_folder(folder: Path, *, max_model_len: int = 512,
                           vocab_size: int = 600) -> Path:
    """A Hugging Face tokenizer folder: ``tokenizer.json`` (byte-level BPE trained on a small
    corpus, specials ``<|im_start|>`` = 0, ``<|im_end|>`` = 1, ``<|endoftext|>`` = 2) and
    ``tokenizer_config.json`` (ChatML template, eos = ``<|im_end|>``, pad = ``<|endoftext|>``,
    no bos, ``model_max_length``). Deterministic: the same folder every time."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[IM_START, IM_END, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_CORPUS] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML_TEMPLATE, "bos_token": None, "eos_token": IM_END,
              "pad_token": PAD, "model_max_length": max_model_len,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


@dataclass(frozen=True, slots=True)
class OneTokenizer:
    """A ``TokenizerSource`` that gives one tokenizer for every model."""

    tokenizer: PdserveTokenizer

    async def for_model(self, deployment: str) -> PdserveTokenizer:
        return self.tokenizer
