"""Where the decoder runs: its own module, so that a python stub whose engine runs in a process of its own
decides that without importing the engine (transformers)."""

from __future__ import annotations

import torch


def choose_device(name: str = "auto") -> torch.device:
    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
