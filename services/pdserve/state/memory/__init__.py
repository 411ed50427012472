"""Embedded hot state: everything in one process, for ``pdserve up`` on one machine and for tests.

One module per store (``workers``, ``tickets``, ``events``, ``targets``, ``tokenizers``),
assembled by ``backend.MemoryStateBackend``. Same semantics, errors and clock as the Redis
backend (both pass ``tests/integration/test_state_contract.py``); the one difference is that
state lives as long as the process. Every method runs its read-check-write without awaiting in
between, under one ``asyncio.Lock``, so each call is atomic with respect to the others, as a Lua
script is in Redis.
"""
