"""The torch modules exported for CLIP towers: pixels or ids → the (optionally normalised) embedding."""

from __future__ import annotations

import torch


class HFVisionTower(torch.nn.Module):
    """``CLIPModel.get_image_features``: vision transformer → pooled output → visual projection."""

    def __init__(self, model, normalize: bool):
        super().__init__()
        self.vision, self.projection, self.normalize = model.vision_model, model.visual_projection, normalize

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.projection(self.vision(pixel_values=pixel_values).pooler_output)
        return torch.nn.functional.normalize(features, dim=-1) if self.normalize else features


class HFTextTower(torch.nn.Module):
    """``CLIPModel.get_text_features``: text transformer → end-of-text token → text projection."""

    def __init__(self, model, normalize: bool):
        super().__init__()
        self.text, self.projection, self.normalize = model.text_model, model.text_projection, normalize

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        features = self.projection(self.text(input_ids=input_ids).pooler_output)
        return torch.nn.functional.normalize(features, dim=-1) if self.normalize else features


class OpenClipTower(torch.nn.Module):
    """open_clip's ``encode_image`` or ``encode_text``."""

    def __init__(self, model, role: str, normalize: bool):
        super().__init__()
        self.model, self.role, self.normalize = model, role, normalize

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.role == "vision":
            return self.model.encode_image(inputs, normalize=self.normalize)
        return self.model.encode_text(inputs, normalize=self.normalize)
