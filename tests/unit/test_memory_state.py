"""The embedded ticket ledger against an exact model, one random call sequence at a time
(the same machine runs against Redis in ``tests/integration/test_state_contract.py``)."""

from __future__ import annotations

from helpers import LedgerModelMachine
from hypothesis import settings


class MemoryLedgerMachine(LedgerModelMachine):
    state_url = None


MemoryLedgerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
test_memory_ledger_matches_its_model = MemoryLedgerMachine.TestCase
