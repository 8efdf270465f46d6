"""Shared machinery of the decoder families (gpt, llama): checkpoint, quantization, engine, repository."""
