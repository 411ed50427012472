"""``nixl``: one-sided KV transfer with NIXL (UCX): the decode side PULLS every layer.

Roles and rendezvous:

- The receiver (decode) owns a NIXL agent with its KV layer buffers registered and listens on a
  small TCP *control* socket (``kv_address``). Nothing else about it leaves the process: its
  ``metadata()`` is empty on purpose. The sender never learns the receiver's memory keys, so it
  cannot WRITE into decode memory at all; only the receiver initiates transfers (READs), into
  blocks it picked, after its own checks. That is the pull model's safety property, built in.
- The sender (prefill) owns one NIXL agent per KV cache (shared by all its tickets) with its
  layer buffers registered. ``open`` connects to the control socket and sends HELLO: the ticket,
  its destination blocks, the KV shape, its agent name, NIXL metadata and the base address of each
  layer buffer. ``offer_layer`` sends LAYER: ``(layer, dst block ids, src block ids)`` — an
  announcement, no KV. ``finish`` sends DONE and waits for the ACK that says every layer is in.
- The receiver runs ``ReceiverTickets.admit_layer`` on each LAYER (fencing token owns the blocks,
  ticket expected and live, layer not yet received) and only then posts one NIXL READ from the
  sender's blocks into its own; consecutive ids on both sides become one descriptor. READs of
  later layers are posted without waiting for earlier ones; a poller drives them and marks each
  layer landed as its READ completes; DONE is answered once the ticket's READs have ended. NIXL
  itself refuses a READ outside the memory the sender registered.
- A sender's agent metadata is loaded once per agent name and kept (a few hundred bytes; a
  restarted prefill worker is a new agent). The control socket is plain TCP without TLS: run
  ``nixl`` on a trusted fabric (``kv_tls`` applies to ``tcp`` only).

Control messages: ``control``. Modules: ``agent`` (NIXL itself), ``control``, ``receiver``,
``sender``, ``backend``.

Progress: the agents run without NIXL's progress thread (it spins a core); each side drives
progress itself. The receiver polls its READs until they end (spinning briefly, then every
``read_poll_interval_s``); the sender polls its agent every ``sender_progress_interval_s`` while
it has a ticket open (UCX needs the target's progress to set up a connection, and on transports
without one-sided support, for every transfer). ``transfer`` may complete inline.

Cancellation: ``cancel`` returns only once no READ of that ticket is in flight: it drives each
for up to ``quiesce_spin_s``, then has NIXL cancel it (bounded by ``quiesce_timeout_s`` if NIXL
cannot), so the agent may free and reassign the blocks right after. Until then the blocks still
belong to the cancelled ticket, so a READ cut short can only have written into blocks of its own
ticket, which is failed and never decoded.

Environment: ``UCX_MODULES`` defaults to ``^ib`` when unset (without InfiniBand devices UCX's ib
module makes processes crash at exit); set it explicitly to use RDMA on a GPU node. Install NIXL
without its dependencies (``pip install --no-deps nixl-cu12``; the plain install pulls CUDA torch).
"""
