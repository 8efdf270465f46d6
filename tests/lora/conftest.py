"""LoRA fixtures: tiny random GPT-2 and Llama bases, two PEFT adapters each, built and served once.

Adapters differ in rank and targets: GPT-2 A (r 4: attn c_attn + c_proj, i.e. attn_qkv + attn_dense and,
since PEFT matches "c_proj" in the MLP too, mlp_4h_to_h), GPT-2 B (r 4 under rsLoRA: mlp c_fc), Llama A
(r 4: q, v, o), Llama B (r 2, down_proj r 4 by rank_pattern with its own alpha: gate, up, down, k).

Two repositories are built with the real CLI for ``--target python``: GPT-2 with the newest backend
profile and a BLS model (adapters loaded at start from the repository, tensorrtllm_backend's lora_prefetch_dir) and Llama
with ``--backend-version v0.15.0`` (no prefetch: the first request of a task carries its weights) and an
adapter cache that holds one adapter at a time. One real tritonserver serves both.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lora_models import make_adapter, make_gpt2, make_llama  # noqa: E402

MAX_INPUT_LEN, MAX_SEQ_LEN = 32, 64
# Llama's LoRA modules (id → (Hi, Ho)) for the tiny model below: hidden 64, 8 heads of 8, 2 KV heads, MLP 96.
LLAMA_SHAPES = {1: (64, 64), 2: (64, 16), 3: (64, 16), 4: (64, 64), 5: (64, 96), 7: (64, 96), 6: (96, 64)}


@pytest.fixture(scope="session", autouse=True)
def lora_environment(tmp_path_factory):
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache")):
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Base models and adapters by name: gpt, gpt_A, gpt_B, llama, llama_A, llama_B."""
    root = tmp_path_factory.mktemp("lora-models")
    gpt = make_gpt2(root / "gpt2-tiny")
    llama = make_llama(root / "llama-tiny", layers=2, tokenizer=True)
    return {
        "gpt": gpt, "llama": llama,
        "gpt_A": make_adapter(gpt, root / "gpt-A", r=4, alpha=8, targets=["c_attn", "c_proj"], seed=1),
        "gpt_B": make_adapter(gpt, root / "gpt-B", r=4, alpha=4, targets=["c_fc"], seed=2, use_rslora=True),
        "llama_A": make_adapter(llama, root / "llama-A", r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"],
                                seed=3),
        "llama_B": make_adapter(llama, root / "llama-B", r=2, alpha=4,
                                targets=["gate_proj", "up_proj", "down_proj", "k_proj"], seed=4,
                                rank_pattern={"down_proj": 4}, alpha_pattern={"down_proj": 8}),
    }


def adapter_bytes(config_npy: Path) -> int:
    """What the python target holds for a Llama adapter (float32 A and B)."""
    import numpy as np

    return sum(int(d) * sum(LLAMA_SHAPES[int(m)]) * 4 for m, _, d in np.load(config_npy)[0])


ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own


def build(*argv: str) -> None:
    from forge.cli import main

    argv = ("build", "--backend-version", ENGINE, "--target", "python", "--dtype", "float32", "--max-input-len", str(MAX_INPUT_LEN),
            "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", "8", "-o", "compute_dtype=float32", *argv)
    assert main(list(argv)) == 0, f"forge {' '.join(argv)} failed"


@pytest.fixture(scope="session")
def repos(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-repos")
    build("--family", "gpt", "--model", str(models["gpt"]), "--name-prefix", "g_", "--out", str(root / "gpt"),
          "--lora", f"A={models['gpt_A']}", "--lora", f"B={models['gpt_B']}", "-o", "bls=true")
    # first a build that says how large the adapters are, then the one whose cache holds only one of them
    probe = root / "probe"
    build("--family", "llama", "--model", str(models["llama"]), "--backend-version", "v0.15.0", "--out", str(probe),
          "--lora", f"A={models['llama_A']}", "--lora", f"B={models['llama_B']}")
    sizes = [adapter_bytes(probe / "tensorrt_llm" / "lora" / str(t) / "model.lora_config.npy") for t in (1, 2)]
    build("--family", "llama", "--model", str(models["llama"]), "--backend-version", "v0.15.0", "--name-prefix", "l_",
          "--out", str(root / "llama"), "--lora", f"A={models['llama_A']}", "--lora", f"B={models['llama_B']}",
          "-o", f"lora_cache_host_memory_bytes={max(sizes)}")
    shutil.rmtree(probe)
    return {"gpt": root / "gpt", "llama": root / "llama"}


@pytest.fixture(scope="session")
def server(repos, tmp_path_factory):
    """One real tritonserver for both repositories (their model names do not clash)."""
    from forge.server.triton_server import TritonServer

    from forge.testing import merge_repositories

    merged = merge_repositories(repos.values(), tmp_path_factory.mktemp("lora-merged") / "repo")
    with TritonServer(merged, log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log") as s:
        yield s
