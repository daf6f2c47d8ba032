"""What several family plans share: head counts read from a config, the separate q/k/v/o projections."""

from __future__ import annotations

from autotp.errors import AutotpError
from autotp.parallel.styles import Colwise, Rowwise, Style


def head_count(config, heads: str) -> int:
    """config.<heads>, checked to be a positive integer: a count of 0 would otherwise surface as a
    ZeroDivisionError in the head_dim division or the head assignment."""
    n = getattr(config, heads)
    if type(n) is not int or n < 1:
        raise AutotpError(f"config.json gives {heads}={n!r}: a model needs at least 1 attention head")
    return n


def head_dim(config, hidden: str, heads: str) -> int:
    """config.<hidden> // config.<heads>, for configs whose heads split the hidden size evenly."""
    n, size = head_count(config, heads), getattr(config, hidden)
    if size % n:
        raise AutotpError(f"config.json gives {hidden}={size}, which does not split into {heads}={n} heads "
                          f"of equal size ({size} % {n} = {size % n})")
    return size // n


def llama_heads(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a Llama-style config (num_attention_heads, optional
    num_key_value_heads, optional head_dim set apart from hidden_size)."""
    heads = head_count(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or head_dim(config, "hidden_size", "num_attention_heads")


def separate_qkvo(prefix: str, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj",
                  o: str = "o_proj") -> dict[str, Style]:
    """Separate query/key/value projections, column-parallel by the rank's query or KV heads, and the
    output projection, row-parallel over the same query heads."""
    return {f"{prefix}.{q}": Colwise(split="q_heads"), f"{prefix}.{k}": Colwise(split="kv_heads"),
            f"{prefix}.{v}": Colwise(split="kv_heads"), f"{prefix}.{o}": Rowwise(split="q_heads")}
