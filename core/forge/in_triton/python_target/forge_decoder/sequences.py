"""A sequence the engine generates, and what one step produced for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from . import guided
from .request import GenerationRequest


@dataclass
class Update:
    """What one step produced for one sequence."""

    tokens: list[int]
    logprobs: list[float]
    generation_logits: list[np.ndarray]
    finished: bool
    reason: str | None = None  # "length", "end_id", "stop_words", "cancelled", "error"
    error: str | None = None
    top: list = field(default_factory=list)  # toplogprobs.Position of each token, when the request asks

    def then(self, later: "Update") -> "Update":
        """This update and the ``later`` one as one: tokens (and their figures) joined, the later one's end."""
        return Update(self.tokens + later.tokens, self.logprobs + later.logprobs,
                      self.generation_logits + later.generation_logits, later.finished, later.reason, later.error,
                      self.top + later.top)


@dataclass(eq=False)
class Sequence:
    """A sequence being generated: its request, its owner's callback and its state."""

    request: GenerationRequest
    on_update: Callable[["Sequence", Update], None]
    is_cancelled: Callable[[], bool] = lambda: False
    owner: Any = None
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    output: list[int] = field(default_factory=list)  # generated tokens reported to the owner
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0  # sum of ``logprobs``
    context_logits: np.ndarray | None = None
    generation_logits: list[np.ndarray] = field(default_factory=list)
    top: list = field(default_factory=list)  # toplogprobs.Position of each output token (top_logprobs asked)
    prompt_top: list | None = None  # toplogprobs.Position of each prompt token (prompt_logprobs asked)
    generator: torch.Generator | None = None
    top_p: float = 0.0
    bias: torch.Tensor | None = None
    matcher: guided.Matcher | None = None  # where the request's guide has got to (guided decoding only)
    cancelled: bool = False
    finished: bool = False
    arrival_ns: int = field(default_factory=time.time_ns)
    arrival_step: int = 0  # the engine's decoding steps when it was submitted
    scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    def cancel(self) -> None:
        """Ask the engine to stop this sequence at its next step (thread-safe)."""
        self.cancelled = True
