"""A pipeline of stages, each a tensor-parallel group: which ranks form each stage, which decoder layers each holds,
and who hands activations to whom. Pure integer arithmetic, no torch.

World = pp x tp. Stage s is ranks [s * tp, (s + 1) * tp), so that launchers that number ranks host by host
(torchrun --nnodes, `--nproc-per-node tp`) put a stage on one host: its tensor-parallel all-reduces stay inside the
host, and only one hidden state per token crosses between hosts. Rank i of stage s hands its hidden states to rank
i of stage s + 1 (every rank of a stage holds them whole after its all-reduce); rank 0 of the last stage, which
holds the logits, hands each step's sampled tokens back to rank 0.

Layers go to stages as evenly as possible, the first stages taking one more (even_split): the last stage also holds
the LM head, a vocabulary's worth of rows. `--pp-layers 18,22` sets them instead, e.g. for GPUs of different sizes.

    Stages.split(pp=2, tp=2, num_layers=30).layers == (15, 15); .span(1) == range(15, 30); .stage(3) == 1
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.errors import AutotpError
from autotp.parallel.partition import even_split


@dataclass(frozen=True)
class Stages:
    pp: int
    tp: int
    layers: tuple[int, ...]  # decoder layers per stage

    @staticmethod
    def split(pp: int, tp: int, num_layers: int, given: tuple[int, ...] | None = None) -> Stages:
        """pp stages of tp ranks over num_layers layers, evenly, or as `given` (--pp-layers); raises naming both
        numbers where they cannot be."""
        if pp < 1 or tp < 1:
            raise AutotpError(f"--pp {pp} and --tp {tp} must both be at least 1")
        if pp > num_layers:
            raise AutotpError(f"--pp {pp} exceeds the model's {num_layers} decoder layers: each stage holds one at "
                              f"least")
        if given is None:
            return Stages(pp, tp, tuple(b - a for a, b in even_split(num_layers, pp)))
        if len(given) != pp:
            raise AutotpError(f"--pp-layers gives {len(given)} stages ({','.join(map(str, given))}) for --pp {pp}")
        if min(given) < 1 or sum(given) != num_layers:
            raise AutotpError(f"--pp-layers {','.join(map(str, given))} must give each stage a layer at least and "
                              f"sum to the model's {num_layers} layers, not {sum(given)}")
        return Stages(pp, tp, tuple(given))

    @property
    def world(self) -> int:
        return self.pp * self.tp

    def stage(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ranks(self, stage: int) -> range:
        return range(stage * self.tp, (stage + 1) * self.tp)

    def span(self, stage: int) -> range:
        """The decoder layers stage `stage` holds."""
        start = sum(self.layers[:stage])
        return range(start, start + self.layers[stage])

    def first(self, rank: int) -> bool:
        return self.stage(rank) == 0

    def last(self, rank: int) -> bool:
        return self.stage(rank) == self.pp - 1

    def next_rank(self, rank: int) -> int | None:
        """The rank this one hands its hidden states to (None on the last stage)."""
        return None if self.last(rank) else rank + self.tp

    def prev_rank(self, rank: int) -> int | None:
        """The rank this one takes its hidden states from (None on the first stage)."""
        return None if self.first(rank) else rank - self.tp

    @property
    def sampler(self) -> int:
        """The rank that turns each step's logits into tokens: rank 0 of the last stage."""
        return (self.pp - 1) * self.tp
