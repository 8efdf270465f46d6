"""forge's minilm family: sentence-transformers text encoders (BERT-style) → sentence embeddings.

The served output is the sentence embedding itself: the ONNX graph contains the transformer, the
pooling that the model's ``modules.json`` configures (mean, CLS, max, mean-sqrt-len) and, when
configured, L2 normalisation. Built alone, the pipeline's ensemble is called ``ensemble`` (what
default clients call); in a multi-family repository it is called ``minilm``.
"""

from forge.encoder.adapter import TEXT, EncoderAdapter, Tower
from forge.encoder.plugin import EncoderPlugin


def _open(path, ctx):
    from .source import SentenceTransformerSource

    return SentenceTransformerSource(path, ctx, ADAPTER)


ADAPTER = EncoderAdapter(
    family="minilm",
    description="sentence-transformers text encoders (all-MiniLM-L6-v2 and other BERT-style models)",
    architectures=("BertModel", "RobertaModel", "XLMRobertaModel", "MPNetModel", "DistilBertModel"),
    towers=(Tower(role="text", modality=TEXT, pipeline="minilm"),),
    open_source=_open,
    tolerance={"float32": 1e-4, "float16": 1e-2, "int8": 0.1},
    solo_ensemble="ensemble",
)

#: The object the ``forge.plugins`` entry point ``minilm = forge_minilm:plugin`` loads.
plugin = EncoderPlugin(ADAPTER)

__all__ = ["ADAPTER", "plugin"]
