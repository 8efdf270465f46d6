"""forge's llama family: Llama/Mistral-style checkpoints → TensorRT-LLM LLaMA engines and Triton repositories."""

from forge.llm.plugin import DecoderPlugin

from .adapter import ADAPTER, LlamaAdapter

#: The object the ``forge.plugins`` entry point ``llama = forge_llama:plugin`` loads.
plugin = DecoderPlugin(ADAPTER)

__all__ = ["ADAPTER", "LlamaAdapter", "plugin"]
