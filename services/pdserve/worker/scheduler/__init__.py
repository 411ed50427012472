"""The in-house runtime: pdserve's own scheduler over a host-memory ``KvCache``, for the engines
that leave scheduling to the agent (``sim``, ``tiny``).

It implements the engine seam (``worker.runtime``) with what a real engine's scheduler does:

- ``engine_thread``: one thread runs the engine (engines are synchronous and not re-entrant;
  prefill and decode steps serialise), and a block allocator over the engine's cache;
- ``prefill``: a FIFO queue of prompts, each computed layer by layer on that thread while the
  layers it has finished go to the destination over the transport, and the prefix cache the
  router is told about;
- ``decode``: admission onto blocks it allocates (the ticket's token becomes their owner through
  ``worker.kv_landing``), the wait for the prompt's KV or a local prefill, and continuous
  batching over every running sequence;
- ``agents``: the agents over these runtimes, built by role (``create_agent``).

A self-scheduling engine (vLLM) replaces all of this; the agents stay.
"""
