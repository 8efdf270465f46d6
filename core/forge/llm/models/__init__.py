"""Triton python-backend models forge copies into decoder repositories (they run inside Triton).

``preprocessing.py``, ``postprocessing.py`` and ``bls.py`` become ``<model>/1/model.py``;
``forge_text.py`` (tokenizer helpers, importable here for tests) is copied next to each of them.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
PREPROCESSING = HERE / "preprocessing.py"
POSTPROCESSING = HERE / "postprocessing.py"
BLS = HERE / "bls.py"
TEXT = HERE / "forge_text.py"
