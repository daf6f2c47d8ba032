"""A pipeline stage's forward: the hidden states the stage before sent go in at its first layer, and come out after
its last, where the next stage takes them (the last stage runs on to the LM head).

Hooks on the stage's model (stage_cut.py made the rest of it stubs), installed once at load:
- on the first layer the stage holds (past stage 0): its hidden_states argument is replaced by what was received,
  (1, tokens, hidden). Where nothing was (the start-up probe) it gets zeros shaped like what the model's own forward
  handed layer 0 (its embeddings' output), so every stage can run a forward alone;
- on the last layer it holds (before the last stage): its output ends the forward (`StageDone`), so the layers
  after it (passthroughs), the final norm and the LM head do not run.
- on the model: its forward runs only through `run` (autotp serve's engine). A stage alone cannot answer a user's
  `model(...)` or `generate`, and says so instead of returning what its stubs make.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autotp.errors import AutotpError


class StageDone(Exception):  # noqa: N818 - not an error: how a stage's forward ends early
    def __init__(self, hidden: torch.Tensor):
        super().__init__("the stage's last layer ran")
        self.hidden = hidden


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class StageIO:
    """Installed on stage `stage` of `pp` as `model.autotp_stage`; `run(call, received)` runs one forward."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, span: range, stage: int, pp: int):
        self.stage, self.pp, self.span = stage, pp, span
        self.received: torch.Tensor | None = None
        self.template: torch.Tensor | None = None  # what layer 0 was handed in this forward
        self.active = False
        model.register_forward_pre_hook(self._guard)
        if span.start > 0:
            layers[0].register_forward_pre_hook(self._record, with_kwargs=True)
            layers[span.start].register_forward_pre_hook(self._enter, with_kwargs=True)
        if stage < pp - 1:
            layers[span.stop - 1].register_forward_hook(self._leave)

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def run(self, call: Callable[[], object], received: torch.Tensor | None = None):
        """call() (a forward of the model) with `received` (1, tokens, hidden) entering the stage's first layer; the
        model's output on the last stage, the hidden states (1, tokens, hidden) its last layer gave on the others."""
        self.received, self.active = received, True
        try:
            return call()
        except StageDone as done:
            return done.hidden
        finally:
            self.received = self.template = None
            self.active = False

    def _guard(self, module, args) -> None:
        if not self.active:
            raise AutotpError(f"this model is stage {self.stage} of a {self.pp}-stage pipeline (layers "
                              f"{self.span.start}-{self.span.stop - 1}): only autotp serve's engine runs its forward")

    def _record(self, module, args, kwargs) -> None:
        self.template = _hidden(args, kwargs)

    def _enter(self, module, args, kwargs):
        hidden = self.received if self.received is not None else torch.zeros_like(self.template)
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": hidden}
        return (hidden, *args[1:]), kwargs

    def _leave(self, module, args, output) -> None:
        raise StageDone(output[0] if isinstance(output, tuple) else output)


def forward(model: nn.Module, call: Callable[[], object], received: torch.Tensor | None = None):
    """call() on a whole model, or through its stage's `run` on a pipeline stage."""
    stage = getattr(model, "autotp_stage", None)
    return call() if stage is None else stage.run(call, received)
