"""The ``vllm`` engine: vLLM schedules, batches and owns its KV blocks; pdserve's ticket model
enters through pdserve's own KV connector.

- ``connector``: the ``KVConnectorBase_V1`` subclass vLLM loads by module path (thin: it picks
  the scheduler-side or worker-side half by role).
- ``scheduler_side``: runs in vLLM's EngineCore process; decides which requests load or send,
  builds the per-step metadata.
- ``worker_side``: runs in vLLM's worker process; owns the KV data path (pdserve's ``tcp``
  transport over vLLM's own KV tensors), the block owner table and the checksums.
- ``engine``: the agent-facing adapter over vLLM's in-process async engine (``AsyncLLM``).

Importing this package does not import vLLM; only ``connector``, ``engine`` and the two sides do.
"""
