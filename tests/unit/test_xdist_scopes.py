"""The suite's pytest-xdist work units (tests/conftest.py): what one worker takes whole."""

from __future__ import annotations

import conftest


def test_a_module_is_one_unit_and_the_vllm_folder_is_one_unit() -> None:
    assert conftest._scope_of("tests/e2e/test_chaos_short.py::test_every_fault") == \
        "tests/e2e/test_chaos_short.py"
    # A class's tests stay with their module (its module-scoped fixtures start services once).
    assert conftest._scope_of("tests/unit/test_x.py::TestA::test_b[1]") == "tests/unit/test_x.py"
    vllm = {conftest._scope_of(f"tests/vllm_engine/{module}::test_a")
            for module in ("test_stack.py", "test_stack_nixl.py", "test_handoff.py")}
    assert vllm == {"tests/vllm_engine"}
    # Node ids relative to another root (pytest run from inside tests/) group the same way.
    assert conftest._scope_of("vllm_engine/test_stack.py::test_a") == "vllm_engine"


class _Item:
    def __init__(self, path: str) -> None:
        self.fspath = conftest.ROOT / "tests" / path
        self.marks: list[str] = []

    def add_marker(self, mark) -> None:
        self.marks.append(mark.name)


def test_collection_puts_the_longest_folders_first_and_marks_by_folder() -> None:
    paths = ["unit/test_a.py", "e2e/test_b.py", "integration/test_c.py", "unit/test_d.py",
             "vllm_engine/test_e.py", "e2e/test_f.py"]
    items = [_Item(path) for path in paths]
    conftest.pytest_collection_modifyitems(None, items)
    assert [str(item.fspath.relative_to(conftest.ROOT / "tests")) for item in items] == [
        "vllm_engine/test_e.py", "e2e/test_b.py", "e2e/test_f.py", "integration/test_c.py",
        "unit/test_a.py", "unit/test_d.py"]  # stable within a folder
    assert [item.marks for item in items] == [[], ["e2e"], ["e2e"], ["integration"], [], []]


def test_auto_worker_count_is_capped(monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert conftest.pytest_xdist_auto_num_workers(None) == conftest.MAX_WORKERS
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0})
    assert conftest.pytest_xdist_auto_num_workers(None) == 1
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "7")
    assert conftest.pytest_xdist_auto_num_workers(None) is None
