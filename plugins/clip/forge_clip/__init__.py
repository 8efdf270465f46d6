"""forge's clip family: CLIP vision and text towers → image and text embeddings.

Two checkpoint formats: Hugging Face ``CLIPModel`` directories, and open_clip models — a directory
with ``open_clip_config.json`` and weights, or a weights file with ``-o model_name=NAME`` (one of
open_clip's shipped configs). Each tower is exported as its own ONNX graph with a dynamic batch
axis and served by its own pipeline: ensemble ``clip_image`` (``image`` bytes → ``embedding``)
and ensemble ``clip_text`` (``text_input`` → ``embedding``). Embeddings are those of
``get_image_features`` / ``encode_image`` (not normalised unless ``-o normalize=true``).
"""

from forge.components import Option
from forge.encoder.adapter import IMAGE, TEXT, EncoderAdapter, Tower
from forge.encoder.plugin import EncoderPlugin


def _open(path, ctx):
    from .sources import open_source

    return open_source(path, ctx, ADAPTER)


ADAPTER = EncoderAdapter(
    family="clip",
    description="CLIP image and text towers (Hugging Face CLIPModel, open_clip)",
    architectures=("CLIPModel",),
    towers=(Tower(role="vision", modality=IMAGE, pipeline="clip_image"),
            Tower(role="text", modality=TEXT, pipeline="clip_text")),
    open_source=_open,
    tolerance={"float32": 1e-4, "float16": 2e-2, "int8": 0.15},
    options=(Option("normalize", "bool", "L2-normalise the served embeddings (as get_image_features: no)", False),
             Option("model_name", "str", "open_clip model name when --model is a weights file", None)),
)

#: The object the ``forge.plugins`` entry point ``clip = forge_clip:plugin`` loads.
plugin = EncoderPlugin(ADAPTER)

__all__ = ["ADAPTER", "plugin"]
