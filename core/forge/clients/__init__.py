"""Clients of a served repository: Triton's generate endpoint and gRPC inference, LoRA adapters by name."""
