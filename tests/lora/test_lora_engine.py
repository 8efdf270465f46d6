"""The continuous-batching engine with adapters: one batch of base, A and B rows, each row its own answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lora_models import greedy, peft_model

from forge.in_triton.python_target.forge_decoder import engine as E
from forge.in_triton.python_target.forge_decoder import lora as L
from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits, RequestError
from forge.in_triton.python_target.forge_decoder.sequences import Sequence


def served_modules(repo, prefix):
    """The module map the build wrote into the python model's config."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((repo / f"{prefix}tensorrt_llm" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    return {int(k): v for k, v in json.loads(config.parameters["lora_modules"].string_value).items()}


@pytest.mark.parametrize("fam,prefix", [("gpt", "g_"), ("llama", "l_")])
def test_one_batch_mixes_base_and_adapter_rows(models, repos, fam, prefix):
    model = E.load_model(models[fam], torch.device("cpu"), torch.float32)
    modules = L.LoraModules(model, served_modules(repos[fam], prefix))
    cache = L.AdapterCache(modules, capacity_bytes=1 << 30, max_rank=64, dtype=torch.float32,
                           device=torch.device("cpu"))
    assert cache.prefetch(repos[fam] / f"{prefix}tensorrt_llm" / "lora") == [1, 2]
    engine = E.Engine(model, Limits(vocab_size=model.config.vocab_size, max_input_len=32, max_seq_len=64), max_rows=16)
    engine.lora = modules
    prompts = [[1, 5, 17, 33], [1, 8, 9], [1, 60, 70, 80, 12]]
    rows = []
    for task in (None, 1, 2):
        for prompt in prompts:
            request = GenerationRequest(prompt=prompt, max_new_tokens=6)
            request.lora_task_id = task
            cache.resolve_rows([request])
            rows.append((task, prompt, Sequence(request, lambda seq, update: None)))
    engine.submit([s for _, _, s in rows])
    engine.run_until_idle()
    assert engine.steps == 5  # 6 tokens: prefill + a decoding step, then four steps, all nine rows together
    for task, prompt, seq in rows:
        adapter = None if task is None else models[f"{fam}_{'AB'[task - 1]}"]
        assert seq.output == greedy(peft_model(models[fam], adapter), prompt, 6), (task, prompt)


def test_cache_evicts_the_least_recently_used_adapter(models, repos):
    model = E.load_model(models["llama"], torch.device("cpu"), torch.float32)
    modules = L.LoraModules(model, served_modules(repos["llama"], "l_"))
    folder = repos["llama"] / "l_tensorrt_llm" / "lora"
    arrays = {t: (np.load(folder / str(t) / L.WEIGHTS_FILE), np.load(folder / str(t) / L.CONFIG_FILE)) for t in (1, 2)}
    probe = L.AdapterCache(modules, capacity_bytes=1 << 30, max_rank=64, dtype=torch.float32, device=torch.device("cpu"))
    sizes = {t: probe.build(*arrays[t]).nbytes for t in (1, 2)}
    cache = L.AdapterCache(modules, capacity_bytes=sizes[1] * 2 + sizes[2] - 1, max_rank=64, dtype=torch.float32,
                           device=torch.device("cpu"), log=lambda message: None)
    cache.resolve(1, *arrays[1])
    cache.resolve(11, *arrays[1])
    cache.resolve(1, None, None)  # task 1 is now the most recently used
    cache.resolve(2, *arrays[2])  # no room for all three: the least recently used (11) goes
    assert list(cache.entries) == [1, 2] and cache.evictions == 1
    with pytest.raises(RequestError, match="LoRA task 11 not found in cache"):
        cache.resolve(11, None, None)
    small = L.AdapterCache(modules, capacity_bytes=sizes[1] - 1, max_rank=64, dtype=torch.float32,
                           device=torch.device("cpu"))
    with pytest.raises(RequestError, match="more than the whole adapter cache"):
        small.resolve(1, *arrays[1])
