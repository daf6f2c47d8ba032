"""Per-rank replacements for `nn.Linear` and `nn.Embedding`.

They are created with parameters on the meta device at their per-rank shapes; whoever creates them
(the sliced loader, or `init_inference` slicing a loaded model) assigns the real tensors. Each keeps
the global size under its own name (`out_features_global`, `num_embeddings_global`) beside the
per-rank one, so `print(model)` shows both. A column- or row-parallel layer's `weight` may be a
`quant.QuantizedWeight` instead of a Parameter (weight-only int8/int4): the forward then runs its kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotp.parallel import gemv
from autotp.parallel.collectives import all_gather_last_dim, all_reduce_sum
from autotp.quant.weights import QuantizedWeight


class ColwiseLinear(nn.Linear):
    """y_local = x @ W_local.T + b_local with W_local the rank's rows of W: (out_per_rank, in). No comms."""

    def __init__(self, in_features: int, out_per_rank: int, out_features_global: int, bias: bool, dtype):
        super().__init__(in_features, out_per_rank, bias=bias, device="meta", dtype=dtype)
        self.out_features_global = out_features_global

    def linear_weight(self) -> torch.Tensor:
        """The weight as F.linear wants it, (out, in); Conv1D subclasses store its transpose."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            y = self.weight.linear(x)
            return y if self.bias is None else y + self.bias
        return gemv.linear(x, self.linear_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, out_features_global={self.out_features_global}"


class RowwiseLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local.T) + b, with W_local the rank's columns of W: (out, in_per_rank).

    The bias is full-size and added once, after the reduction: adding it before would add it tp times.
    """

    def __init__(self, in_per_rank: int, out_features: int, in_features_global: int, bias: bool, dtype, group):
        super().__init__(in_per_rank, out_features, bias=bias, device="meta", dtype=dtype)
        self.in_features_global = in_features_global
        self.group = group

    def linear_weight(self) -> torch.Tensor:
        """The weight as F.linear wants it, (out, in_per_rank); Conv1D subclasses store its transpose."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            y = all_reduce_sum(self.weight.linear(x), self.group)
        elif self.group is None:  # one rank: nothing to reduce, so keep the fused matmul + bias
            return gemv.linear(x, self.linear_weight(), self.bias)
        else:
            y = all_reduce_sum(gemv.linear(x, self.linear_weight()), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in_features_global={self.in_features_global}"


class ColwiseConv1D(ColwiseLinear):
    """ColwiseLinear whose weight keeps HF Conv1D's checkpoint layout: (in, out_per_rank) (GPT-2)."""

    def __init__(self, in_features: int, out_per_rank: int, out_features_global: int, bias: bool, dtype):
        super().__init__(in_features, out_per_rank, out_features_global, bias, dtype)
        self.weight = nn.Parameter(torch.empty(in_features, out_per_rank, device="meta", dtype=dtype),
                                   requires_grad=False)

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class RowwiseConv1D(RowwiseLinear):
    """RowwiseLinear whose weight keeps HF Conv1D's checkpoint layout: (in_per_rank, out) (GPT-2)."""

    def __init__(self, in_per_rank: int, out_features: int, in_features_global: int, bias: bool, dtype, group):
        super().__init__(in_per_rank, out_features, in_features_global, bias, dtype, group)
        self.weight = nn.Parameter(torch.empty(in_per_rank, out_features, device="meta", dtype=dtype),
                                   requires_grad=False)

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start, vocab_stop) live on this rank: weight (rows_per_rank, dim).

    Each rank looks up the ids it owns, writes zeros for the others, and the all-reduce fills them in.
    `embed_scale` (a 0-d tensor, Gemma's scaled embedding) multiplies the gathered rows as HF does.
    """

    def __init__(self, num_embeddings_global: int, embedding_dim: int, vocab_start: int, vocab_stop: int,
                 padding_idx: int | None, dtype, group, embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.embed_scale = embed_scale
        self.num_embeddings_global = num_embeddings_global
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_stop = vocab_start, vocab_stop
        self.padding_idx = padding_idx  # kept for HF code that reads it; inference does not use it
        self.group = group
        self.weight = nn.Parameter(torch.empty(vocab_stop - vocab_start, embedding_dim, device="meta", dtype=dtype),
                                   requires_grad=False)

    @property
    def num_embeddings(self) -> int:
        return self.num_embeddings_global

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = all_reduce_sum(F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0), self.group)
        return out if self.embed_scale is None else out * self.embed_scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"rows {self.vocab_start}:{self.vocab_stop} of {self.num_embeddings_global}, "
                f"embedding_dim={self.embedding_dim}")


class VocabParallelLMHead(nn.Linear):
    """Output projection over this rank's vocabulary rows, logits gathered to the full vocabulary.

    weight (rows_per_rank, hidden); the gather makes every rank's logits identical, so every rank's
    generate (greedy, sampling with the same seed, beam search) picks the same tokens.
    """

    def __init__(self, in_features: int, vocab_sizes: list[int], bias: bool, dtype, group, rank: int):
        super().__init__(in_features, vocab_sizes[rank], bias=bias, device="meta", dtype=dtype)
        self.vocab_sizes = vocab_sizes
        self.out_features_global = sum(vocab_sizes)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (..., hidden) as (tokens, hidden): generate keeps the last position, a (1, 1, hidden) view with the
        # strides of (1, prompt, hidden), and F.linear on that view copied the whole bf16 weight for the product
        # (+48 MiB peak per rank for starcoderbase-1b at tp 4; 7 MiB on the 2-D view; benchmarks/load_memory.py)
        y = gemv.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        return all_gather_last_dim(y, self.vocab_sizes, self.group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, out_features_global={self.out_features_global}"


class SumOverRanks:
    """Forward hook: the module's output, summed over the ranks of `group` (the module computed a partial sum).

    For a module whose forward is the model's own and whose output is a sum over the features the rank
    holds, e.g. fused experts with each expert's intermediate features split: one all-reduce of the
    combined output, after the routing weights and the sum over experts. The module must add no bias
    after that sum (the style that registers the hook checks).
    """

    def __init__(self, group):
        self.group = group

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(output, self.group)
