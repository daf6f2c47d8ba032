"""Partition arithmetic: which rank owns which heads, rows or columns.

Pure integer arithmetic, no tensors and no torch.distributed, so it can be checked exhaustively. Every
split in autotp goes through `even_split` (one place decides what "as even as possible" means) or
`assign_heads` (heads go to ranks whole, and a rank never holds a query head without its KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.errors import AutotpError


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` contiguous pieces of `total`; the first total % parts get one more.

    even_split(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    if parts < 1:
        raise AutotpError(f"cannot split {total} into {parts} parts")
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_stop), KV heads [kv_start, kv_stop).

    The global counts are kept beside the local ones so that a style can turn heads into rows without
    looking anything up again.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    head_dim: int
    total_q_heads: int
    total_kv_heads: int

    @property
    def q_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def kv_heads(self) -> int:
        return self.kv_stop - self.kv_start

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head on this rank (HF's `num_key_value_groups`)."""
        return self.q_heads // self.kv_heads


def assign_heads(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> list[HeadShard]:
    """Give every rank whole query heads together with the KV heads they attend with.

    - num_kv_heads >= tp: KV groups (a KV head and its num_heads/num_kv_heads query heads) are split
      evenly, so no KV head is stored twice.
    - num_kv_heads < tp: each KV head is replicated to the ranks that share its query heads; the ranks are
      spread over KV heads as evenly as possible and each KV head's query heads as evenly as possible over
      its ranks. Multi-query attention (one KV head) is the case num_kv_heads == 1.
    Every rank's query heads then use its KV heads in equal numbers, as HF's `repeat_kv` requires.
    """
    if tp < 1:
        raise AutotpError(f"tp_size must be at least 1, got {tp}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise AutotpError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    if tp > num_heads:
        raise AutotpError(
            f"tp_size {tp} exceeds the {num_heads} query heads: at most {num_heads} ranks can hold a head"
        )
    group = num_heads // num_kv_heads

    def shard(q: tuple[int, int], kv: tuple[int, int]) -> HeadShard:
        return HeadShard(*q, *kv, head_dim, num_heads, num_kv_heads)

    if num_kv_heads >= tp:
        return [shard((a * group, b * group), (a, b)) for a, b in even_split(num_kv_heads, tp)]

    # At most ceil(tp / num_kv_heads) <= group ranks share a KV head (tp <= num_heads), so each gets a head.
    shards = []
    for kv, (r0, r1) in enumerate(even_split(tp, num_kv_heads)):
        for a, b in even_split(group, r1 - r0):
            shards.append(shard((kv * group + a, kv * group + b), (kv, kv + 1)))
    return shards
