"""The prefix cache: KV state of token sequences already computed, kept in blocks so a new
request that starts with the same tokens (a shell loop's shared instructions, a chat that
resends its conversation) computes only what follows.

A block is BLOCK consecutive positions of one sequence: a block of the model's KV pool
(engine/sequence.KVPool: what the family's cache holds per token: keys and values, the
compressed latent for MLA, the indexer keys for DSA). It is found by a hash chained from the start of
the sequence, key(block i) = H(key(block i-1), its tokens), so a block stands for its
whole prefix, not only its own tokens (vLLM's automatic prefix caching; SGLang's radix
tree is the same tree, token-granular). Its tokens are kept and compared too: a hash
collision can cost a lookup, never a wrong position.

Sharing: a block exists once, whatever number of sequences passed through it: the
sequence that computed it keeps it in its table, the cache holds it too, and a request
that matches it puts the same block in its own table (the attention kernels read a
sequence's blocks through its table), so nothing is copied. Running requests that matched
a block hold a reference, and eviction (least recently used first, under a byte budget)
takes only blocks no running request holds, with their descendants (which no request can
hold either: a request holds the whole chain it matched); a block leaves the pool when
neither the cache nor any sequence holds it. A full block never changes (a sequence only
appends positions), so sharing it is safe.

Exactness: a position's keys and values do not depend on which positions shared its step
(the kernels compute every row on its own), so a prefix restored from blocks continues as
computed afresh. The blocks come from prompt rows; rows of sampled tokens are kept too
where the family's decode rows are the same bits as prompt rows (Model.DECODE_ROWS_EXACT).

Hybrids: a linear-attention layer's recurrent state covers every position it has seen and
cannot be cut back, so a block may carry a snapshot of the sequence's state right after
it (Block.state, its bytes counted in the budget). A request of a model with a state
starts from the deepest matched block that has one: the KV blocks of its full-attention
layers up to there, and the state restored from the snapshot. Snapshots are taken where a
prompt's computation is made to pause (Request.feed): every `snapshot_tokens` positions
and at the last block boundary of each prompt, so a request that resends a conversation or
shares a long system prompt resumes from near its end (the recurrent kernels give the
same bits in chunks as in one step: pausing changes nothing but the reads).
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .sequence import KV_BLOCK as BLOCK  # tokens per block


@dataclass(eq=False)
class Block:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    bid: int  # its block in the KV pool (held by the cache)
    nbytes: int
    refs: int = 0  # running requests that hold it
    children: set = field(default_factory=set)
    state: dict | None = None  # a hybrid sequence's recurrent state right after this block (a copy)


def chain(parent: bytes | None, tokens) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


class PrefixCache:
    """Blocks of KV state under a byte budget. Used by the engine thread only (the daemon's
    stats read its counters)."""

    SNAPSHOT_TOKENS = 1024  # a hybrid's state is kept every this many positions of a prompt (daemon: auto)

    def __init__(self, budget_bytes: int, snapshot_tokens: int = SNAPSHOT_TOKENS):
        self.budget = budget_bytes
        self.set_snapshot_tokens(snapshot_tokens)
        self.pool = None  # the KV pool of the blocks (the first inserted cache's)
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.counters = {"lookups": 0, "hit_requests": 0, "hit_tokens": 0, "inserted_blocks": 0,
                         "evicted_blocks": 0, "state_snapshots": 0}

    def set_snapshot_tokens(self, n: int) -> None:
        """Keep a hybrid's state every n prompt positions (whole blocks) from the next
        request on."""
        self.snapshot_tokens = max(BLOCK, n // BLOCK * BLOCK)

    def describe(self) -> dict:
        return {"block_tokens": BLOCK, "snapshot_tokens": self.snapshot_tokens, "blocks": len(self.blocks), "bytes": self.bytes, "budget_bytes": self.budget,
                "held_blocks": sum(1 for b in self.blocks.values() if b.refs), **self.counters,
                "saved_prefill_tokens": self.counters["hit_tokens"],
                "pool_blocks": self.pool.used if self.pool is not None else None,
                "pool_bytes": self.pool.used * self.pool.block_bytes if self.pool is not None else None}

    def reach(self, tokens: list[int], pool=None) -> int:
        """Positions of `tokens` the cache holds KV blocks for (match's walk, nothing held):
        where a hybrid's prompt diverges from what was computed before, a snapshot there
        serves the next request that shares as much."""
        parent, n = None, 0
        if pool is not None and self.pool not in (None, pool):
            return 0
        for i in range((len(tokens) - 1) // BLOCK):
            part = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            b = self.blocks.get(chain(parent, part))
            if b is None or b.tokens != part or b.parent != parent:
                break
            parent, n = b.key, n + BLOCK
        return n

    def match(self, tokens: list[int], pool=None, state: bool = False) -> list[Block]:
        """The cached blocks of the longest prefix of `tokens` (whole blocks, leaving at
        least one token to compute: the next token's logits need its row), now held by the
        caller until release(). `pool`: the caller's KV pool (blocks of another model's
        pool are no match). `state`: the caller keeps a recurrent state, so the prefix
        ends at the deepest block with a state snapshot."""
        self.counters["lookups"] += 1
        got, parent = [], None
        n = (len(tokens) - 1) // BLOCK if pool is None or self.pool in (None, pool) else 0
        for i in range(n):
            part = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            b = self.blocks.get(chain(parent, part))
            if b is None or b.tokens != part or b.parent != parent:
                break
            got.append(b)
            parent = b.key
        if state:
            while got and got[-1].state is None:
                got.pop()
        for b in got:
            b.refs += 1
        self.touch(got)
        if got:
            self.counters["hit_requests"] += 1
            self.counters["hit_tokens"] += len(got) * BLOCK
        return got

    def release(self, blocks: list[Block]) -> None:
        for b in blocks:
            b.refs -= 1
        self.evict(0)

    def insert(self, tokens: list[int], cache, n_pos: int, state: dict | None = None) -> int:
        """Keep the whole blocks of the first n_pos positions of `cache` (which holds
        `tokens` at them) that are not cached yet; returns how many were added. Stops at
        the first block the budget has no room for (the chain's earlier blocks are held
        meanwhile: making room never takes them). A hybrid's state goes with the last block
        when n_pos is a block boundary: `state`, the sequence's at n_pos, or the cache's
        own when it is at n_pos."""
        if self.pool not in (None, cache.pool):
            return 0  # (another model's blocks are kept here)
        added, parent, path = 0, None, []
        try:
            for i in range(n_pos // BLOCK):
                part = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
                key = chain(parent, part)
                b = self.blocks.get(key)
                if b is not None and (b.tokens != part or b.parent != parent):
                    break  # a hash collision: keep what is there
                if b is None:
                    nbytes = cache.pool.block_bytes
                    if not self.evict(nbytes):
                        break
                    bid = int(cache.table[i])
                    cache.pool.hold(bid)  # shared with the sequence that computed it: no copy
                    self.pool = cache.pool
                    b = Block(key, parent, part, bid, nbytes)
                    self.blocks[key] = b
                    self.bytes += nbytes
                    if parent is not None:
                        self.blocks[parent].children.add(key)
                    added += 1
                b.refs += 1
                path.append(b)
                parent = key
            if state is None and n_pos == cache.n_pos:
                state = cache.state
            if state and n_pos % BLOCK == 0 and len(path) == n_pos // BLOCK and path \
                    and path[-1].state is None:  # the state right after the last block
                need = sum(a.nbytes for a in state.values())
                if self.evict(need):
                    path[-1].state = {k: a.copy() for k, a in state.items()}
                    path[-1].nbytes += need
                    self.bytes += need
                    self.counters["state_snapshots"] += 1
        finally:
            self.touch(path)
            for b in path:
                b.refs -= 1
        self.counters["inserted_blocks"] += added
        return added

    def touch(self, path: list[Block]) -> None:
        """Mark a chain most recently used, its end first, so that of a chain the least
        recently used block is its last: eviction shortens prefixes from their ends
        instead of cutting them at the root (vLLM frees a request's blocks in that order)."""
        for b in reversed(path):
            self.blocks.move_to_end(b.key)

    def evict(self, need: int) -> bool:
        """Make room for `need` more bytes under the budget, least recently used first,
        never a block a running request holds; False when that cannot be done."""
        if need > self.budget:
            return False
        for key in list(self.blocks):
            if self.bytes + need <= self.budget:
                break
            b = self.blocks.get(key)
            if b is not None and not b.refs:
                self.drop(b)
        return self.bytes + need <= self.budget

    def drop(self, b: Block) -> None:
        """Remove a block and its descendants (none held: a holder holds the whole chain)."""
        for child in list(b.children):
            if child in self.blocks:
                self.drop(self.blocks[child])
        del self.blocks[b.key]
        self.pool.drop([b.bid])
        self.bytes -= b.nbytes
        self.counters["evicted_blocks"] += 1
        if b.parent is not None and b.parent in self.blocks:
            self.blocks[b.parent].children.discard(b.key)

    def resize(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.evict(0)


def load_blocks(cache, blocks: list[Block]) -> None:
    """A fresh request's cache starts from matched blocks: its first len(blocks) * BLOCK
    positions are those blocks, shared; a recurrent state from the last one's snapshot."""
    cache.adopt([b.bid for b in blocks])
    if blocks and cache.state:
        for name, a in blocks[-1].state.items():
            cache.state[name][...] = a


def snapshot_interval(setting: int | str, model) -> int:
    """The prompt positions between two state snapshots: a number as given, or `auto`:
    as many positions as take the KV bytes one snapshot takes (state bytes / KV bytes a
    token, in whole blocks), so that snapshots at most double the prefix cache's bytes of a
    long prompt. That follows the model: 3,184 for a Qwen3.5-122B-shaped stack (4.3 MB of
    state a linear layer, 4 KiB of KV a token a full layer, three to one), ~1,600 for
    Qwen3-Next-80B; closer snapshots cost their bytes for a few hundred tokens of prompt
    computed again by the first request that shares part of a prefix (bench/prefix.py
    --parts e measures both)."""
    if setting != "auto":
        return int(setting)
    state, kv = model.state_bytes_per_sequence(), model.kv_bytes_per_token()
    if not state or not kv:
        return PrefixCache.SNAPSHOT_TOKENS  # (no state, or no KV to weigh it against)
    return max(BLOCK, round(state / kv / BLOCK) * BLOCK)


def pause_points(n_prompt: int, every: int, reach: int = 0) -> list[int]:
    """Where a hybrid's prompt of n_prompt tokens pauses so that its state can be kept:
    every `every` positions, at its last block boundary, and at `reach` (where it leaves
    the cached blocks)."""
    last = n_prompt // BLOCK * BLOCK
    return sorted({p for p in (*range(every, n_prompt, every), last, reach) if 0 < p < n_prompt})
