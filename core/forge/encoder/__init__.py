"""Shared machinery of the encoder families (clip, minilm): ONNX export with parity, ONNX Runtime
quantization, trtexec compilation, Triton configs and the python-backend preprocessing models.

A family plugin is an :class:`~forge.encoder.adapter.EncoderAdapter` (towers, architectures,
tolerances) plus a checkpoint reader implementing :class:`~forge.encoder.adapter.EncoderSource`;
:class:`~forge.encoder.plugin.EncoderPlugin` turns the pair into forge hook implementations.
"""
