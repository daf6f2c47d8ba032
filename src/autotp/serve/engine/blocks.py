"""The KV cache's blocks as rank 0 accounts for them: free, held by rows, or cached for a later prompt.

Pure bookkeeping on block ids (no torch): the tensors live in runner/kv_cache.py, on every rank, and every rank
reads the block tables rank 0 sends. A block holds the keys and values of `block_size` consecutive tokens
of one sequence, in every layer.

Prefix caching, as vLLM v1 does it: a full block is keyed by (its parent block's key, its token ids), so
a key names a whole prefix. A new prompt walks its full blocks from the first and takes every block
already cached under the same key; only the rest is computed. A block nobody holds stays cached (its
key kept) in least-recently-used order until its room is needed: `take` evicts the oldest one first.

Within a block, reuse is token-granular: every block whose tokens are known (a full cached one, and the partly
filled last block of a row that left, its "tail") is indexed under its parent key, and `extend` finds, after
the full blocks a prompt matched, the one sharing the longest run of the prompt's next tokens. Its keys and
values are copied into the new row's own block (every rank, before the step's forward): an editor's prompt
that differs from the last one after its cursor computes from the cursor on, not from the start of the
cursor's block. Copied, not taken over: the source stays cached for the prompts after it.

Reservations make admission safe without preemption: a row admitted with a budget of `n` tokens
reserves the blocks it can ever need, and `take` only ever hands out reserved room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

Key = int
# `extend` compares at most this many blocks, the last indexed first: a cached system prompt may have thousands of
# known blocks after it that start alike, and an admission must not cost milliseconds; the last ones are the likely
# match (the same editor's previous keystroke, the same chat's last turn)
EXTEND_CANDIDATES = 64


def block_key(parent: Key | None, tokens: tuple[int, ...]) -> Key:
    """A full block's key: deterministic in-process (hash of a tuple of ints), chained through its parent."""
    return hash((parent, tokens))


class BlockPool:
    """num_blocks blocks of block_size tokens. `caching` off: a block is forgotten as soon as it is free."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never written or forgotten; pop() = lowest
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.key_of: dict[int, Key] = {}
        self.content: dict[Key, tuple[int, Key | None, tuple[int, ...]]] = {}  # key -> (block, parent, tokens)
        self.tails: dict[int, tuple[Key | None, tuple[int, ...]]] = {}  # idle partly filled block -> (parent, tokens)
        # (parent, first token) -> {block: its known tokens}: the candidates `extend` compares, by their first token
        # so that the first block's many siblings (parent None) are not all compared
        self.children: dict[tuple[Key | None, int], dict[int, tuple[int, ...]]] = {}
        self.reserved = 0  # blocks promised to admitted rows and not yet taken

    def available(self) -> int:
        """Blocks that can still be promised: free or idle-cached, less what is already reserved."""
        return len(self.free) + len(self.idle) - self.reserved

    def used(self) -> int:
        """Blocks held by rows."""
        return self.num_blocks - len(self.free) - len(self.idle)

    def match(self, tokens: tuple[int, ...] | list[int], limit: int) -> list[tuple[int, Key]]:
        """(block, key) of the cached blocks of the longest run of tokens' full blocks, at most `limit`."""
        out: list[tuple[int, Key]] = []
        parent: Key | None = None
        size = self.block_size
        for i in range(min(limit, len(tokens) // size)):
            chunk = tuple(tokens[i * size:(i + 1) * size])
            key = block_key(parent, chunk)
            found = self.content.get(key)
            if found is None or found[1] != parent or found[2] != chunk:  # absent, or a hash collision
                break
            out.append((found[0], key))
            parent = key
        return out

    def extend(self, tokens: Sequence[int], hits: list[tuple[int, Key]], end: int) -> tuple[int, int]:
        """(block, m): the known block under the last hit's key (the first block's parent when none) whose first m
        tokens are tokens[len(hits) * size:end], for the largest m (at most end - len(hits) * size), among the
        EXTEND_CANDIDATES indexed last; (-1, 0) when none shares a first token."""
        start = len(hits) * self.block_size
        want = tuple(tokens[start:min(end, start + self.block_size)])
        best, most = -1, 0
        if not want:
            return best, most
        siblings = self.children.get((hits[-1][1] if hits else None, want[0]), {})
        for block, known in islice(reversed(siblings.items()), EXTEND_CANDIDATES):
            m = 0
            for a, b in zip(want, known, strict=False):
                if a != b:
                    break
                m += 1
            if m > most:
                best, most = block, m
                if m == len(want):
                    break
        return best, most

    def reserve(self, blocks: int) -> None:
        if blocks > self.available():
            raise RuntimeError(f"cannot reserve {blocks} blocks: {self.available()} available")
        self.reserved += blocks

    def unreserve(self, blocks: int) -> None:
        self.reserved -= blocks

    def hold(self, block: int) -> None:
        """A row shares a cached block (a prefix hit): it is no longer idle."""
        if self.refs[block] == 0:
            del self.idle[block]
        self.refs[block] += 1

    def take(self) -> int:
        """A block for a row, out of its reservation: a free one, else the least recently used idle one."""
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.idle.popitem(last=False)
            self._forget(block)
        self.reserved -= 1
        self.refs[block] = 1
        return block

    def release(self, block: int, tail: tuple[Key | None, tuple[int, ...]] | None = None) -> None:
        """A row lets go of a block: cached blocks go idle (most recently used last), others free. tail: (parent,
        tokens) of a row's partly filled last block whose first len(tokens) keys and values are computed: it goes
        idle too, indexed for `extend` until its room is needed."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.idle[block] = None
            elif tail is not None and tail[1] and self.caching:
                self.tails[block] = tail
                self.children.setdefault((tail[0], tail[1][0]), {})[block] = tail[1]
                self.idle[block] = None
            else:
                self.free.append(block)

    def _forget(self, block: int) -> None:
        """An idle block's content is no longer findable (evicted or flushed)."""
        if block in self.tails:
            parent, tokens = self.tails.pop(block)
        else:
            _, parent, tokens = self.content.pop(self.key_of.pop(block))
        siblings = self.children[parent, tokens[0]]
        del siblings[block]
        if not siblings:
            del self.children[parent, tokens[0]]

    def flush(self) -> int:
        """Forget every cached block nobody holds (`POST /flush_cache`): each becomes free, its key gone, so no later
        prompt finds it. Returns how many. Blocks that rows hold keep their keys."""
        for block in self.idle:
            self._forget(block)
            self.free.append(block)
        flushed = len(self.idle)
        self.idle.clear()
        return flushed

    def register(self, block: int, parent: Key | None, tokens: tuple[int, ...]) -> Key:
        """A held block is now full with tokens, its keys and values computed: cache it under its key.
        Returns the key (its children's parent). A second block with the same content stays uncached."""
        key = block_key(parent, tokens)
        if self.caching and key not in self.content:
            self.content[key] = (block, parent, tokens)
            self.key_of[block] = key
            self.children.setdefault((parent, tokens[0]), {})[block] = tokens
        return key
