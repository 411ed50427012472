"""Hot state on Redis (``redis.asyncio``), shared by every replica of every control-plane service.

One module per store (``workers``, ``tickets``, ``events``, ``targets``, ``tokenizers``),
assembled by ``backend.RedisStateBackend``; ``keys`` holds the key layout, ``calls`` how a store
talks to Redis (Lua scripts, their replies, connection failures) and ``codec`` the text form of
values.

Block accounting and ticket rules are those of the ``TicketLedger`` contract
(``pdserve.state.interfaces``), as the memory backend implements them; here each ledger step is
one Lua script (``pdserve/state/lua/*.lua``), so it is atomic across processes.

Times are the injected (coordinator) clock's, passed into scripts as arguments; Redis's own clock
only drives backstop expiries (``PEXPIRE``) that delete data the clock has already retired.
Connection failures raise ``UnavailableError``: the client does not retry by itself, because a
retried script may already have run (a write's outcome is then unknown; leases and
reconciliation clean up what a lost reply leaves behind).
"""
