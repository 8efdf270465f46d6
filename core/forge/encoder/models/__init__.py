"""Triton python-backend models that emit_config copies into repositories as ``1/model.py``.

Each file is self-contained (it runs inside tritonserver's python stub, not inside forge) and keeps
its processing logic importable without Triton so the build can run the very same code for parity.
"""

from pathlib import Path

HERE = Path(__file__).parent
TOKENIZER = HERE / "tokenizer.py"
IMAGE = HERE / "image.py"
ONNX_ENCODER = HERE / "onnx_encoder.py"
