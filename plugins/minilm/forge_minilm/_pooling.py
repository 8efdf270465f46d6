"""The torch module exported for sentence-transformers models: encoder, pooling, normalisation."""

from __future__ import annotations

import torch


class SentenceEmbedding(torch.nn.Module):
    """input_ids, attention_mask → the sentence embedding, as sentence-transformers computes it."""

    def __init__(self, model: torch.nn.Module, modes: tuple[str, ...], normalize: bool):
        super().__init__()
        self.model, self.modes, self.normalize = model, modes, normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = []
        for mode in self.modes:
            if mode == "cls":  # the first unmasked token
                first = attention_mask.to(torch.int32).argmax(dim=1)
                pooled.append(tokens[torch.arange(tokens.shape[0]), first])
            elif mode == "max":
                pooled.append(tokens.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
            else:
                total = (tokens * mask).sum(dim=1)
                count = torch.clamp(mask.sum(dim=1), min=1e-9)
                pooled.append(total / (count if mode == "mean" else torch.sqrt(count)))
        embedding = torch.cat(pooled, dim=-1)
        return torch.nn.functional.normalize(embedding, p=2, dim=1) if self.normalize else embedding
