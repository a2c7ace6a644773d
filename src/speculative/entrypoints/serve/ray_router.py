"""Prefix-aware routing for `serve --ray`: requests that share a long prompt prefix go to
the replica that served it last, while load allows.

The one cache a replica keeps between requests is `--draft suffix`'s suffix cache (prompt
lookup's n-grams and the KV caches are per request), so with it a conversation's next turn
or a re-sent document can draft from what that replica generated before; with other drafts
routing changes nothing measurable (benchmarks/serve_ray_routing.py). The ingress cuts each
prompt's leading tokens into blocks of BLOCK_TOKENS and hashes them as a chain (block i's
key covers blocks 0..i, as vLLM's prefix-cache keys do); the router keeps, per key, the
replica a request holding it went to (LRU, at most `max_keys`), and sends a request to the
owner of its longest known key unless that replica is `imbalance` requests busier than the
least busy one (queue lengths from Serve's cache, no extra probe). Without a known key it
chooses as Serve's default does (the less busy of two at random).

Ray Serve's own PrefixCacheAffinityRouter (ray.serve.llm) does the same on characters, but
keeps its prefix tree in one detached actor that every routing decision calls with ray.get;
ours is a dict in each handle's router (the ingress replicas'), so routing costs no remote
call and needs no actor outliving the application.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_TOKENS = 16  # tokens per hashed block: a prompt shorter than this has no key
MAX_BLOCKS = 64  # keys per request: prefixes beyond 1024 tokens do not sharpen the choice


def prefix_keys(tokens: list[int], block: int = BLOCK_TOKENS, most: int = MAX_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's whole leading blocks, shortest prefix first."""
    keys, digest = [], b""
    for start in range(0, min(len(tokens) // block, most) * block, block):
        chunk = ",".join(map(str, tokens[start:start + block])).encode()
        digest = hashlib.blake2b(digest + chunk, digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little"))
    return keys


class PrefixRouter(RequestRouter):
    """Serve's RequestRouter keyed on `prefix_keys` (the `prefix_keys` attribute of a call's
    first argument); see the module docstring."""

    def initialize_state(self, imbalance: int = 8, max_keys: int = 100_000) -> None:
        self.imbalance, self.max_keys = imbalance, max_keys
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        owner = self.owner(candidate_replicas, keys_of(pending_request))
        others = [r for r in candidate_replicas if owner is None or r.replica_id != owner.replica_id]
        two = random.sample(others, min(2, len(others)))
        return [[owner], two] if owner is not None else [two]

    def owner(self, candidates: list[RunningReplica], keys: list[int]) -> RunningReplica | None:
        """The replica that holds the longest known prefix, unless it is too busy."""
        by_id = {r.replica_id: r for r in candidates}
        for key in reversed(keys):
            replica = by_id.get(self.owners.get(key))
            if replica is None:
                continue
            lengths = [self._replica_queue_len_cache.get(r.replica_id) for r in candidates]
            mine = self._replica_queue_len_cache.get(replica.replica_id)
            known = [n for n in lengths if n is not None]
            if mine is not None and known and mine - min(known) > self.imbalance:
                return None
            return replica
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for key in keys_of(pending_request):
            self.owners[key] = replica_id
            self.owners.move_to_end(key)
        while len(self.owners) > self.max_keys:
            self.owners.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self.owners.items() if owner == replica_id]:
            del self.owners[key]


def keys_of(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    return list(getattr(pending_request.args[0], "prefix_keys", None) or [])
