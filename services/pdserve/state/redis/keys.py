"""Redis key names of the hot state, all under one prefix.

Keys are ``<prefix>:<area>:<entity>:<id>``; every key one script touches carries the decode
worker's hash tag ``{w:<worker_id>}`` (or ``{d:<deployment>}`` for the change stream), so the
scripts run unchanged on Redis Cluster::

    <p>:ledger:{w:W}            hash  num_total_blocks, num_reserved_blocks, num_held_blocks;
                                      w_deployment, w_state, w_expires_s (DecodeWorkerView)
    <p>:leases:{w:W}            zset  ticket id -> lease deadline (tickets with reserved blocks)
    <p>:tickets:{w:W}           zset  ticket id -> purge time (+inf while it owns blocks)
    <p>:ticket:{w:W}:T          hash  one ticket
    <p>:ticketidx:{X}:T         str   T -> W, read before a script to build its keys; X, the
                                      first characters of T, hash to W's slot (``slot_tag``)
    <p>:ticketidx:T             str   the same, as releases before the slotted index wrote it
                                      (still written beside it, best effort, and read when the
                                      slotted one is missing: a fleet mid-upgrade mixes both)
    <p>:ledger:workers          set   workers with a ledger (for reap_expired over all)
    <p>:tickets:workers         set   workers with tickets (for list_tickets over all)
    <p>:worker:record:W         hash  worker record, PEXPIRE'd by heartbeat
    <p>:worker:members:D:R      set   worker ids of deployment D, role R (stale ones dropped lazily)
    <p>:worker:deployments      set   deployments with workers
    <p>:events:meta:{d:D}       hash  epoch, seq of D's change stream
    <p>:events:stream:{d:D}     stream of D's pool events, ids "<seq>-0"
    <p>:target:D:R              str   target pool size
    <p>:tokenizer:bundle:S      hash  tokenizer bundle with digest S, PEXPIRE'd by touch
    <p>:threshold:published     hash  local-prefill threshold in force per deployment
                                      ('t:D'), publication count ('v:D')

Beside them, on the same URL (their modules own the names)::

    <p>:prefix:D:W                      set   prefix hashes worker W holds (prefix_index)
    <p>:experts:{D|R}:reports           list  expert-load reports of one pool (expert_loads)
    <p>:experts:pools                   set   pools with reports
    <p>:rendezvous:T:A                  str   a ticket attempt's destination, plus a pub/sub
                                              channel of the same name (kv_transfer.rendezvous)
    <p>:lease:{N}, <p>:lease:{N}:epoch  str   leadership lease N and its fencing counter
                                              (common.leadership)

Slots, on a Redis Cluster: what must change atomically shares a slot, nothing else does.
- One decode worker's ledger, leases, ticket index and tickets share ``{w:W}``: opening a
  ticket reserves blocks of that ledger, and reaping, reconciling or dropping the worker touches
  all of its tickets, each in one script. Tickets of different workers never share a script.
- One deployment's change-stream meta and stream share ``{d:D}`` (a publish counts and appends
  in one script); a lease and its counter share ``{N}``; each other key is alone in its script
  or transaction (worker records, tokenizer bundles, a pool's expert reports, prefix sets,
  the published thresholds: one hash that one script writes).
- A ticket id starts with characters that hash to its decode worker's slot (``slot_tag``), so
  its id index lives there too: opening a ticket writes only that slot, and whoever holds a
  ticket id finds its worker there, with no other master involved.
- Everything else is untagged so it spreads over every master: worker records by worker, and
  workers' ledgers by their own tags. The few global sets (workers with ledgers or tickets,
  deployments, expert pools) are each one key written with plain commands beside a script,
  never inside one (on one node, the ticket open's script adds to the set of workers with
  tickets itself); like all hot state they are rebuilt from heartbeats after a loss.
- What opening a ticket checks of its decode worker (deployment, state, record expiry) is kept
  in the worker's ledger hash (``w_*`` fields, ``DecodeWorkerView``), so the open reads no
  worker record first.
- Multi-key pipelines (a worker upsert, listings) are not transactions: a cluster client splits
  them per node, and nothing relies on them being atomic.
The prefix itself may not carry a hash tag (``StateOptions``): it would put every key in one slot.
"""

from __future__ import annotations

import functools
import itertools
import random
from binascii import crc_hqx

from pdserve.common.types import WorkerRole

CLUSTER_SLOTS = 16_384
SLOT_TAG_LENGTH = 5
"""Hex characters at the start of a ticket id that make its index key's hash tag: 16**5 tags
cover all 16,384 Redis Cluster slots (about 64 tags each)."""


def key_slot(hash_tag: str) -> int:
    """The Redis Cluster slot of a key whose hash tag is ``hash_tag`` (CRC16 of the tag)."""
    return crc_hqx(hash_tag.encode(), 0) % CLUSTER_SLOTS


@functools.lru_cache(maxsize=4096)
def slot_tag(worker_id: str) -> str:
    """A tag of ``SLOT_TAG_LENGTH`` hex characters in the same slot as ``worker_id``'s keys
    (``{w:<worker_id>}``); found by trying tags from a random start, about 16,000 of them (some
    milliseconds, once per worker)."""
    target = key_slot(f"w:{worker_id}")
    start = random.randrange(16**SLOT_TAG_LENGTH)
    for n in itertools.chain(range(start, 16**SLOT_TAG_LENGTH), range(start)):
        tag = f"{n:0{SLOT_TAG_LENGTH}x}"
        if key_slot(tag) == target:
            return tag
    raise AssertionError(f"no {SLOT_TAG_LENGTH}-character tag hashes to slot {target}")


class RedisKeys:
    """Key names under one prefix (see the module docstring for the layout)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def ledger(self, worker_id: str) -> str:
        return f"{self.prefix}:ledger:{{w:{worker_id}}}"

    def leases(self, worker_id: str) -> str:
        return f"{self.prefix}:leases:{{w:{worker_id}}}"

    def ticket_index(self, worker_id: str) -> str:
        return f"{self.prefix}:tickets:{{w:{worker_id}}}"

    def ticket(self, worker_id: str, ticket_id: str) -> str:
        return f"{self.prefix}:ticket:{{w:{worker_id}}}:{ticket_id}"

    def ticket_owner(self, ticket_id: str) -> str:
        """The id index in the ticket's worker's slot (when the id was minted for that worker:
        ``slot_tag``; elsewhere for ids of earlier releases, which use ``legacy_ticket_owner``)."""
        return f"{self.prefix}:ticketidx:{{{ticket_id[:SLOT_TAG_LENGTH]}}}:{ticket_id}"

    def legacy_ticket_owner(self, ticket_id: str) -> str:
        return f"{self.prefix}:ticketidx:{ticket_id}"

    def ledger_workers(self) -> str:
        return f"{self.prefix}:ledger:workers"

    def ticket_workers(self) -> str:
        return f"{self.prefix}:tickets:workers"

    def ledger_keys(self, worker_id: str) -> list[str]:
        """The first three keys of every ticket script."""
        return [self.ledger(worker_id), self.leases(worker_id), self.ticket_index(worker_id)]

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:record:{worker_id}"

    def worker_members(self, deployment: str, role: WorkerRole | str) -> str:
        return f"{self.prefix}:worker:members:{deployment}:{role}"

    def worker_deployments(self) -> str:
        return f"{self.prefix}:worker:deployments"

    def events_meta(self, deployment: str) -> str:
        return f"{self.prefix}:events:meta:{{d:{deployment}}}"

    def events_stream(self, deployment: str) -> str:
        return f"{self.prefix}:events:stream:{{d:{deployment}}}"

    def target(self, deployment: str, role: WorkerRole | str) -> str:
        return f"{self.prefix}:target:{deployment}:{role}"

    def thresholds(self) -> str:
        return f"{self.prefix}:threshold:published"

    def tokenizer_bundle(self, sha256: str) -> str:
        return f"{self.prefix}:tokenizer:bundle:{sha256}"
