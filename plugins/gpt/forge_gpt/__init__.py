"""forge's gpt family: GPT-2 checkpoints → TensorRT-LLM GPTForCausalLM engines and Triton repositories."""

from forge.llm.plugin import DecoderPlugin

from .adapter import ADAPTER, GPTAdapter

#: The object the ``forge.plugins`` entry point ``gpt = forge_gpt:plugin`` loads.
plugin = DecoderPlugin(ADAPTER)

__all__ = ["ADAPTER", "GPTAdapter", "plugin"]
