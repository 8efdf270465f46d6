"""The static-KV-cache decoding step (graphs.GraphDecoder) against transformers, run eagerly on the CPU.

On a GPU the same step is captured as CUDA graphs (``-o cuda_graphs``, default auto); what can be
checked without one is its arithmetic: greedy ids equal ``generate`` token for token in float32 for
each architecture it takes (Llama with GQA, Qwen2's q/k/v biases, Qwen3's q/k norms; GPT-2 in
tests/serve/test_engine.py's ``gpt2-static`` runs),
with rows joining and leaving, and the refusals (``-o cuda_graphs=true`` where it cannot run).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from forge.in_triton.python_target.forge_decoder import architectures, cpu_kernels, graphs  # noqa: E402
from forge.in_triton.python_target.forge_decoder.engine import Engine  # noqa: E402
from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits  # noqa: E402
from forge.in_triton.python_target.forge_decoder.sequences import Sequence  # noqa: E402

VOCAB = 160
NOTES = {"fused": "fused (one Triton kernel writes and attends)", "cpu": "cpu (forge's C kernel)"}
PAGED = {"block": 4, "blocks": 40}  # blocks of 4 tokens; 40 blocks: fewer than 4 rows × 64 columns
SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)


def _random(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((0.2 if p.dim() > 1 else 0.05) * torch.randn(p.shape, generator=gen) + (p.dim() == 1))
    return model.eval()


def _model(kind: str):
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=VOCAB)
        torch.manual_seed(0)
        return _random(transformers.GPT2LMHeadModel(config), 4)
    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    config = getattr(transformers, config_cls)(**SHAPE, **extra, tie_word_embeddings=kind == "qwen2")
    torch.manual_seed(0)
    return _random(getattr(transformers, model_cls)(config), {"llama": 1, "qwen2": 2, "qwen3": 3}[kind])


def _generate(model, prompt, n):
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def outputs(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    """Every request's generated tokens, all submitted at once."""
    seqs = [Sequence(r, lambda s, u: None) for r in requests]
    engine.submit(seqs)
    engine.run_until_idle()
    return [s.output for s in seqs]


@pytest.mark.parametrize("kind, attention, compiled", [
    *((kind, attention, compiled) for kind in ("llama", "qwen2", "qwen3")
      for attention, compiled in (("sdpa", None), ("matmul", None), ("sdpa", "eager"), ("cpu", None))),
    ("llama", "fused", "eager"), ("qwen2", "fused", None), ("qwen3", "fused", None)])
def test_static_cache_step_equals_transformers_generate(kind, attention, compiled, monkeypatch):
    """Five prompts of different lengths through 3 slots (rows join late and leave early), column buckets
    of 8 so caches cross buckets: every row's greedy ids equal its own ``generate``, with either form of the
    step's attention (the fused Triton kernel through Triton's interpreter, the C kernel of a CPU), and with the
    layers' pieces traced by
    torch.compile (``Fused``; the eager backend here: its arithmetic, not the fused kernels)."""
    _static_run(kind, attention, compiled, monkeypatch)


@pytest.mark.parametrize("attention", ["fused", "cpu"])
def test_gpt2_static_step_through_each_kernel_equals_transformers_generate(attention, monkeypatch):
    """GPT-2's step (its queries scaled per layer, keys and values sliced from one projection) through the fused
    kernel and the CPU one: the same rows joining and leaving, greedy ids equal to ``generate``."""
    _static_run("gpt2", attention, None, monkeypatch)


def _kernel_here(attention: str) -> None:
    """Skip a run through the CPU kernel on a CPU without AVX-512 (the decoder keeps SDPA there)."""
    if attention == "cpu" and "avx512f" not in cpu_kernels._cpu_flags():
        pytest.skip("this CPU has no AVX-512")


def _static_run(kind, attention, compiled, monkeypatch):
    _kernel_here(attention)
    monkeypatch.setattr(graphs, "FIRST_COLUMNS", 8)
    monkeypatch.setattr(graphs, "ATTENTION", attention)
    model = _model(kind)
    reference = _model(kind)  # the decoder fuses the projections of the model it serves; compare with a twin
    prompts = [[5, 17, 30, 4], [9] * 11, [1], list(range(40, 63)), [7, 8, 9, 10, 11, 12, 13]]
    lengths = [12, 5, 20, 9, 15]
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=3)
    note = NOTES.get(attention, attention)
    gemms = "GPT2Decoder does not pack its weights" if kind == "gpt2" else "torch.float32 (bfloat16 only)"
    cache, chosen = engine.use_graphs("auto", capture=False, compile="auto").split("; ", 1)
    assert cache.startswith("static KV cache of ") and chosen == (
        f"attention {note}; GEMMs plain ({gemms}), eager (no capture; torch.compile off (the step is not captured "
        "on a GPU))")
    if compiled:
        assert engine.graphs.use_compile("true", backend=compiled) == f"on ({compiled})"
    outputs: dict[int, list[int]] = {}
    seqs = [Sequence(GenerationRequest(p, n), lambda s, u: outputs.setdefault(id(s), []).extend(u.tokens))
            for p, n in zip(prompts, lengths)]
    engine.submit(seqs[:3])
    for _ in range(4):
        engine.step()
    engine.submit(seqs[3:])
    engine.run_until_idle()
    for seq, prompt, n in zip(seqs, prompts, lengths):
        assert outputs[id(seq)] == _generate(reference, prompt, n), prompt


@pytest.mark.parametrize("heads, kv, dim, page", [(4, 2, 16, 0), (9, 3, 64, 0), (8, 8, 32, 0), (8, 2, 128, 0),
                                                  (9, 3, 64, 16), (8, 2, 128, 64)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_fused_kernel_writes_and_attends_as_sdpa(heads, kv, dim, page, dtype):
    """decode_kernel (Triton's interpreter here) for rows at position 0, inside the first block of columns, past
    several blocks and at the spare column (padding: itself alone), with the queries, keys and values strided
    slices of one projection as the step passes them, over static slots or blocks of ``page`` tokens shuffled over
    a pool (each row's block table): its result equals SDPA's row by row, and the cache differs from before only in
    each row's new key and value at its position. ``check`` passes for the shape; a kernel that skipped the new
    token would not match."""
    from forge.in_triton.python_target.forge_decoder import decode_kernel

    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(heads + dim)
    spare = 300
    table = None
    if page:
        width = spare // page + 1
        table = torch.randperm(5 * width, generator=gen).reshape(5, width)
        cache = torch.randn((2, 5 * width, kv, page, dim), generator=gen).to(dtype)
    else:
        cache = torch.randn((2, 6, kv, spare + 1, dim), generator=gen).to(dtype)
    projected = torch.randn((5, heads + 2 * kv, dim), generator=gen).to(dtype)
    q, k, v = projected[:, :heads] * dim ** -0.5, projected[:, heads:heads + kv], projected[:, heads + kv:]
    pos = torch.tensor([0, 7, 64, 299, spare])
    ours, theirs = cache.clone(), cache.clone()
    got = decode_kernel.attend_and_write(q, k, v, ours[0], ours[1], pos, spare, table)
    want = decode_kernel.reference(q, k, v, theirs[0], theirs[1], pos, spare, table)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-3)
    assert torch.equal(ours, theirs)
    changed = (ours != cache).any(dim=-1).nonzero().tolist()  # (keys/values, slot or block, head, column)
    where = [(row, p) if table is None else (int(table[row, p // page]), p % page) for row, p in enumerate(pos.tolist())]
    assert sorted(changed) == sorted([which, slot, head, column] for which in (0, 1) for slot, column in where
                                     for head in range(kv))
    assert decode_kernel.check(heads, kv, dim, dtype, torch.device("cpu"), page) is None
    earlier = torch.tensor([0, 6, 63, 298, spare])  # rows 1-3 one column back: their own token not counted
    without_own = decode_kernel.reference(q, k, v, cache.clone()[0], cache.clone()[1], earlier, spare, table)
    assert not torch.allclose(got[1:4].float(), without_own[1:4].float(), atol=1e-2)


def test_the_fused_kernel_refuses_what_it_cannot_run():
    """Head dims that are not a power of two, and paged blocks of fewer than 16 tokens, keep SDPA (the reason is
    logged); asking for the fused form there is an error."""
    from forge.in_triton.python_target.forge_decoder import decode_kernel

    assert decode_kernel.unsupported(4, 2, 80, torch.float16) == \
        "its head dim 80 is not a power of two of at least 16"
    assert decode_kernel.unsupported(4, 2, 8, torch.float16) == \
        "its head dim 8 is not a power of two of at least 16"
    decoder = architectures.decoder_for(_model("llama"), 2, 32, capture=False, paged=PAGED)
    form = "cpu (forge's C kernel)" if "avx512f" in cpu_kernels._cpu_flags() else \
        "sdpa (not the CPU kernel: this CPU has no AVX-512)"
    assert decoder.describe().endswith(  # auto on a CPU: never the fused kernel
        f"attention {form}; GEMMs plain (torch.float32 (bfloat16 only))")
    with pytest.raises(ValueError, match="the fused decoding attention cannot run here: its KV-cache blocks of 4 "
                                         "tokens are not a power of two of at least 16"):
        graphs.GraphDecoder._attention(decoder, "fused")


@pytest.mark.parametrize("kind, compiled, paged", [
    ("llama", None, None), ("qwen2", None, None), ("qwen3", None, None), ("gpt2", None, None),
    ("llama", "eager", None), ("qwen2", "eager", None), ("qwen3", "eager", None), ("llama", None, PAGED),
    ("gpt2", None, PAGED)])
def test_prefill_equals_transformers_forward_of_each_prompt_alone(kind, compiled, paged):
    """Three prompts of different lengths in one prefill, right-padded, into slots 1-3 (slot 0 is taken):
    every position's logits equal transformers' forward of that prompt alone in float32, each slot's keys
    and values equal that forward's cache, and the argmax picks equal the last position's argmax; the same
    with the layers' pieces traced by torch.compile, and into the blocks of a paged cache."""
    from forge.in_triton.python_target.forge_decoder import kvcache

    model, reference = _model(kind), _model(kind)
    decoder = architectures.decoder_for(model, 4, 64, capture=False, paged=paged)
    if compiled:
        decoder.use_compile("true", backend=compiled)
    decoder.used = 1
    prompts = [[5, 17, 30, 4], list(range(40, 63)), [9]]
    ids = torch.zeros((3, 23), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = torch.tensor(prompt)
    with torch.no_grad():
        logits = decoder.prefill(ids, [len(p) for p in prompts], all_logits=True)
        picks, _ = decoder.greedy(3)
        for i, prompt in enumerate(prompts):
            out = reference(torch.tensor([prompt]), use_cache=True)
            torch.testing.assert_close(logits[i, :len(prompt)], out.logits[0], atol=1e-4, rtol=1e-4)
            assert picks[i] == int(out.logits[0, -1].argmax())
            for layer, (k, v) in enumerate(kvcache.layers(out.past_key_values)):
                keys, values = decoder.cache.read_slot(layer, 1 + i, len(prompt))
                torch.testing.assert_close(keys[0], k[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(values[0], v[0], atol=1e-5, rtol=1e-5)
    assert decoder.used == 4
    with pytest.raises(RuntimeError, match="5 rows do not fit the 4 slots"):
        decoder.prefill(ids[:1], [4])


class _Replayed:
    """What stands in for a CUDA graph on the CPU: ``replay`` runs the captured function into static outputs."""

    def __init__(self, run):
        self.replay = run


def _prefill_standin(self, rows, columns):
    """GraphDecoder._capture_prefill on the CPU: the prefill run on its static inputs into static outputs."""
    inputs = torch.zeros((rows, columns + 3), dtype=torch.long)
    ids, slots, last, banned = self.prefill_views(inputs)
    slots.fill_(self.spare_slot)
    banned.fill_(-1)
    logits, picks = (t.clone() for t in self._prefill_logits(ids, slots, last, banned))

    def run():
        for out, value in zip((logits, picks), self._prefill_logits(ids, slots, last, banned)):
            out.copy_(value)

    self.prefill_graphs[(rows, columns)] = (_Replayed(run), inputs, logits, picks)


@pytest.mark.parametrize("paged", [None, PAGED])
def test_a_captured_prefill_pads_its_bucket_into_the_spare_slot(monkeypatch, paged):
    """The replay path of a captured prefill on the CPU, the CUDA graph stood in for by the captured function
    run on its static inputs: two prompts (widths 5 and 11) go in the (2, 16) bucket, a third alone in (1, 16);
    logits, picks and slots equal the eager prefill's, and slots past the admitted ones stay untouched (paged:
    the padding goes to the spare block, the fourth slot holds no block)."""
    model = _model("llama")
    eager = architectures.decoder_for(model, 4, 64, capture=False)
    captured = architectures.decoder_for(model, 4, 64, capture=False, paged=paged)
    captured.prefill_capture = True
    monkeypatch.setattr(graphs.GraphDecoder, "_capture_prefill", _prefill_standin)
    prompts = [[5, 17, 30, 4, 8], list(range(40, 51))], [[9, 9, 2]]
    with torch.no_grad():
        for batch in prompts:
            ids = torch.zeros((len(batch), max(map(len, batch))), dtype=torch.long)
            for i, prompt in enumerate(batch):
                ids[i, :len(prompt)] = torch.tensor(prompt)
            lengths = [len(p) for p in batch]
            want, got = eager.prefill(ids, lengths), captured.prefill(ids, lengths)
            torch.testing.assert_close(got, want)
            (tokens, logprobs), (want_tokens, want_logprobs) = captured.greedy(len(batch)), eager.greedy(len(batch))
            assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert sorted(captured.prefill_graphs) == [(1, 16), (2, 16)]
    for layer in range(len(captured.keys)):
        for slot, length in enumerate((5, 11, 3)):  # past a prompt's length: padding nobody attends to
            for got, want in zip(captured.cache.read_slot(layer, slot, length), eager.cache.read_slot(layer, slot, length)):
                torch.testing.assert_close(got, want)
        if paged:
            assert captured.cache.slot_blocks[3] == []
        else:
            assert not captured.keys[layer][3].any()  # the fourth slot: nobody's
    assert captured.used == 3


def test_sampled_and_processed_rows_share_the_static_step():
    """A row with a repetition penalty and a sampled row beside a greedy one: the graph's argmax is used
    only when every row is plain greedy; the others go through the sampler (seeded: reproducible)."""
    from forge.in_triton.python_target.forge_decoder.request import SamplingParams

    model = _model("llama")

    def run(use_graphs: bool) -> list[list[int]]:
        engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=4)
        if use_graphs:
            engine.use_graphs("auto", capture=False)
        reqs = [GenerationRequest([5, 6, 7], 10),
                GenerationRequest([5, 6, 7], 10, sampling=SamplingParams(repetition_penalty=1.5)),
                GenerationRequest([5, 6, 7], 10, sampling=SamplingParams(top_k=5, temperature=0.8, seed=11))]
        return outputs(engine, reqs)

    plain, static = run(False), run(True)
    assert static == plain
    assert static[0] != static[1]  # the penalty changed that row's tokens


def test_what_cannot_decode_through_graphs_says_why():
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=VOCAB)).eval()
    assert "BloomForCausalLM is neither a Llama-style nor a GPT-2 model" in architectures.unsupported(bloom, 128)
    engine = Engine(bloom, Limits(VOCAB, 64, 128))
    assert engine.use_graphs("auto", capture=False).startswith("off (BloomForCausalLM is neither")
    assert engine.graphs is None
    with pytest.raises(ValueError, match="-o cuda_graphs=true: cannot decode through CUDA graphs: Bloom"):
        engine.use_graphs("true", capture=False)
    llama = Engine(_model("llama"), Limits(VOCAB, 64, 128))
    with pytest.raises(ValueError, match="-o cuda_graphs=true: cannot decode through CUDA graphs: the model runs on"):
        llama.use_graphs("true")
    assert llama.use_graphs("false") == "off (-o cuda_graphs=false)"
    with pytest.raises(ValueError, match="-o cuda_graphs='maybe': expected auto, true or false"):
        llama.use_graphs("maybe")  # a hand-edited config.pbtxt: refused at load, not read as auto
    with pytest.raises(ValueError, match="-o torch_compile=true belongs to the CUDA-graph decoder; it needs"):
        llama.use_graphs("false", compile="true")
    with pytest.raises(ValueError, match="-o torch_compile='yes': expected auto, true or false"):
        llama.use_graphs("auto", compile="yes")
    gpt2 = architectures.decoder_for(_model("gpt2"), 2, 64, capture=False)
    with pytest.raises(ValueError, match="-o torch_compile=true: cannot compile .*GPT2Decoder has no compiled"):
        gpt2.use_compile("true")


def test_on_a_cpu_auto_runs_the_static_decoder_eagerly_and_its_cache_fits_the_host():
    """-o cuda_graphs=auto on a CPU: the static decoder, uncaptured, its greedy tokens the Hugging Face forward's;
    a KV cache past the host memory it may take (a fraction of what is available) is paged, or with
    -o paged_kv_cache=false leaves the decoder off, saying why."""
    llama = Engine(_model("llama"), Limits(VOCAB, 64, 128), max_rows=4)
    chosen = llama.use_graphs("auto")
    assert chosen.startswith("static KV cache") and "eager (no capture; torch.compile off" in chosen, chosen
    assert llama.graphs is not None and not llama.graphs.capture
    plain = Engine(_model("llama"), Limits(VOCAB, 64, 128), max_rows=4)
    prompts = [[1, 5, 17, 33], [1, 8, 9]]
    runs = []
    for engine in (llama, plain):
        rows = [Sequence(GenerationRequest(prompt=p, max_new_tokens=8), lambda seq, update: None) for p in prompts]
        engine.submit(rows)
        engine.run_until_idle()
        runs.append([row.output for row in rows])
    assert runs[0] == runs[1] and all(len(out) == 8 for out in runs[0])
    tiny = 1e-9  # of the available memory: less than one sequence's blocks
    paged = Engine(_model("llama"), Limits(VOCAB, 64, 128), max_rows=4)
    assert paged.use_graphs("auto", memory_fraction=tiny).startswith("off (a paged KV cache in 0.0 GiB holds 0 blocks")
    static = Engine(_model("llama"), Limits(VOCAB, 64, 128), max_rows=4)
    assert "of free host memory it may take" in static.use_graphs("auto", paged="false", memory_fraction=tiny)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_on_a_cpu_bfloat16_gemms_run_on_weights_packed_once(kind, monkeypatch):
    """An uncaptured bfloat16 decoder packs its GEMMs' weights for oneDNN (q/k/v with Qwen2's biases, gate/up,
    output, down, the head): its prefill and step logits are transformers' forward in bfloat16, as close as
    the unpacked decoder's; float32 keeps plain weights (packed ones would accumulate in another order), as does
    a model whose copies would take over a quarter of the available memory."""
    from forge.in_triton.python_target.forge_decoder import cpu_gemm

    reference = _model(kind).to(torch.bfloat16)
    packed = architectures.decoder_for(_model(kind).to(torch.bfloat16), 2, 64, capture=False)
    assert packed.packed is not None and packed.describe().endswith("; GEMMs packed for oneDNN (cpu_gemm)")
    monkeypatch.setattr(cpu_gemm, "unpackable", lambda *args: "off for the comparison")
    plain = architectures.decoder_for(_model(kind).to(torch.bfloat16), 2, 64, capture=False)
    assert plain.packed is None and plain.describe().endswith("; GEMMs plain (off for the comparison)")
    monkeypatch.undo()
    prompt = [5, 17, 30, 4, 60, 61]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + [11]])).logits[0].float()
        for decoder in (packed, plain):
            first = decoder.prefill(torch.tensor([prompt]), [len(prompt)], all_logits=True)[0].float()
            step = decoder.step([11], [len(prompt)]).float()
            for got, want in ((first, expected[:-1]), (step[0], expected[-1])):
                error = (got - want).abs().max().item()
                assert error < 0.05 * max(1.0, want.abs().max().item()), (decoder.packing, error)
    assert architectures.decoder_for(_model(kind), 2, 64, capture=False).packing == "plain (torch.float32 (bfloat16 only))"
    small = architectures.decoder_for(_model(kind).to(torch.bfloat16), 2, 64, capture=False, available=1 << 16)
    assert small.packed is None and "would take over a quarter of the available memory" in small.packing


def test_compiled_pieces_fuse_kernels_and_keep_the_logits():
    """The layers' pieces compiled by inductor (the fused kernels a GPU runs; C++ kernels on a CPU): a step of
    3 rows and a prefill of 2 prompts give the eager pieces' logits in float32, and the compiled functions
    serve every layer without recompiling (one form per leading shape)."""
    model = _model("qwen3")
    plain = architectures.decoder_for(model, 3, 64, capture=False)
    fused = architectures.decoder_for(model, 3, 64, capture=False)
    from torch._dynamo.utils import counters

    assert fused.use_compile("true") == "on (inductor)"
    compiled = counters["stats"]["unique_graphs"]
    ids = torch.tensor([[5, 17, 30, 4, 0], [9, 8, 7, 6, 5]])
    with torch.inference_mode():
        expected = [plain.prefill(ids, [4, 5]), plain.step([11, 12], [4, 5]), plain.prefill(ids[:1, :3], [3]),
                    plain.step([1, 2, 3], [5, 6, 3]), plain.step([4], [7])]
        got = [fused.prefill(ids, [4, 5]), fused.step([11, 12], [4, 5]), fused.prefill(ids[:1, :3], [3]),
               fused.step([1, 2, 3], [5, 6, 3]), fused.step([4], [7])]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == compiled  # the warm-up compiled every form these use


def test_steps_with_a_lora_adapter_run_through_the_hooked_modules():
    """A LoRA build: rows with an adapter and rows without share a batch; a step with an adapter in it
    runs eagerly through the projection modules (their hooks add the deltas), the others through the
    fused weights. Tokens equal the plain engine's (Hugging Face forward with the same hooks)."""
    from forge.in_triton.python_target.forge_decoder import lora

    modules = {0: "model.layers.{i}.self_attn.q_proj", 1: "model.layers.{i}.self_attn.v_proj",
               2: "model.layers.{i}.mlp.down_proj"}
    gen = torch.Generator().manual_seed(5)

    def adapter(model):
        deltas = {}
        for (module_id, layer), (hi, ho) in lora.LoraModules(model, modules).shapes.items():
            deltas[(module_id, layer)] = (torch.randn(4, hi, generator=gen), 0.5 * torch.randn(ho, 4, generator=gen))
        return lora.Adapter(deltas, task_id=1, rank=4)

    def run(use_graphs: bool) -> list[list[int]]:
        gen.manual_seed(5)
        model = _model("llama")
        engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=4)
        engine.lora = lora.LoraModules(model, modules)
        if use_graphs:
            assert engine.use_graphs("true", capture=False).startswith("static KV cache")
        tuned = adapter(model)
        reqs = [GenerationRequest([5, 6, 7], 12), GenerationRequest([5, 6, 7], 6), GenerationRequest([9, 3], 6)]
        reqs[1].lora = tuned
        return outputs(engine, reqs)

    plain, static = run(False), run(True)
    assert static == plain
    assert static[0][:6] != static[1]  # the adapter changed its row's tokens; row 0 ends without adapters


def _run(engine: Engine, requests: list[GenerationRequest], late: int = 0) -> list[Sequence]:
    """Submit ``requests`` (the last ``late`` of them after four steps) and run until idle."""
    seqs = [Sequence(r, lambda s, u: None) for r in requests]
    engine.submit(seqs[:len(seqs) - late])
    for _ in range(4):
        engine.step()
    engine.submit(seqs[len(seqs) - late:])
    engine.run_until_idle()
    return seqs


@pytest.mark.parametrize("kind, attention, block", [("llama", "sdpa", 4), ("qwen3", "sdpa", 4), ("gpt2", "sdpa", 4),
                                                   ("llama", "fused", 16), ("llama", "cpu", 4), ("gpt2", "cpu", 4)])
def test_paged_cache_step_equals_transformers_generate(kind, attention, block, monkeypatch):
    """A paged KV cache of 48 tokens in blocks (12 of 4, or 3 of 16: the fused kernel reads blocks of at least 16)
    for 3 rows of up to 48 tokens (static slots would take 144): five prompts join late and leave early, a sequence
    waits for blocks when its prompt + max_tokens do not fit beside the running ones, blocks go back as rows leave;
    every row's greedy ids equal its own ``generate`` in float32, and every block is free at the end."""
    _kernel_here(attention)
    monkeypatch.setattr(graphs, "FIRST_COLUMNS", 8)
    monkeypatch.setattr(graphs, "BLOCK_TOKENS", block)
    monkeypatch.setattr(graphs, "ATTENTION", attention)
    model, reference = _model(kind), _model(kind)
    prompts = [[5, 17, 30, 4], [9] * 11, [1], list(range(40, 63)), [7, 8, 9, 10, 11, 12, 13]]
    lengths = [12, 5, 20, 9, 15]
    engine = Engine(model, Limits(VOCAB, 40, 48), max_rows=3)
    blocks = 48 // block
    chosen = engine.use_graphs("auto", capture=False, paged="true", blocks=blocks)
    note = NOTES.get(attention, attention)
    assert chosen.startswith(f"paged KV cache of 0 MiB: {blocks} blocks of {block} tokens; attention {note}; GEMMs "
                             "plain (")
    waited = []
    real = engine.graphs.cache.room

    def room(needs):  # record when admission holds a sequence back for blocks
        fits = real(needs)
        if not fits:
            waited.append(needs)
        return fits

    monkeypatch.setattr(engine.graphs.cache, "room", room)
    seqs = _run(engine, [GenerationRequest(p, n) for p, n in zip(prompts, lengths)], late=2)
    for seq, prompt, n in zip(seqs, prompts, lengths):
        assert seq.output == _generate(reference, prompt, n), prompt
    assert waited  # 1 + 20 tokens (6 blocks of 4, 2 of 16) did not fit beside the first two at first
    cache = engine.graphs.cache
    assert sorted(cache.free) == list(range(blocks)) and sum(cache.promised) == 0


def test_paged_cache_reuses_a_shared_prompt_prefix(monkeypatch):
    """-o enable_kv_cache_reuse: prompts sharing a 9-token prefix (2 full blocks of 4): the later ones
    prefill only their own tokens, attending to the shared blocks (their keys and values equal a fresh
    prefill's), while the first runs and after it finished; ids equal ``generate``. A prompt that differs in
    the first block shares nothing; a pool under pressure gives the idle cached blocks back."""
    monkeypatch.setattr(graphs, "FIRST_COLUMNS", 8)
    monkeypatch.setattr(graphs, "BLOCK_TOKENS", 4)
    model, reference = _model("llama"), _model("llama")
    engine = Engine(model, Limits(VOCAB, 100, 64), max_rows=3)
    engine.use_graphs("auto", capture=False, reuse=True, blocks=16)
    cache = engine.graphs.cache
    prefix = [5, 17, 30, 4, 9, 9, 2, 1, 33]
    starts = []
    real_admit = cache.admit
    monkeypatch.setattr(cache, "admit", lambda slot, need, prompt=None: starts.append(real_admit(slot, need, prompt))
                        or starts[-1])
    first, second = _run(engine, [GenerationRequest(prefix + [40, 41], 6), GenerationRequest(prefix + [50], 8)], late=1)
    assert starts == [0, 8]  # the second shares the first's two full blocks (it prefills positions 8-9)
    third, = _run(engine, [GenerationRequest(prefix + [60, 61, 62], 5)])  # after both finished: idle blocks
    other, = _run(engine, [GenerationRequest([6] + prefix[1:] + [40], 4)])  # differs in the first block
    assert starts[2:] == [8, 0]
    for seq, prompt, n in ((first, prefix + [40, 41], 6), (second, prefix + [50], 8),
                           (third, prefix + [60, 61, 62], 5), (other, [6] + prefix[1:] + [40], 4)):
        assert seq.output == _generate(reference, prompt, n), prompt
    # pressure: a long request needs every block; the idle indexed ones give way, their index entries go
    long, = _run(engine, [GenerationRequest(list(range(70, 120)), 14)])
    assert long.output == _generate(reference, list(range(70, 120)), 14)
    assert {key[1] for key in cache.index} == {tuple(range(70 + 4 * i, 74 + 4 * i)) for i in range(12)}
    assert sorted(cache.free + list(cache.idle)) == list(range(16)) and not any(cache.refs)


def test_the_fused_kernel_reads_a_shared_prompt_prefix_through_the_block_table(monkeypatch):
    """-o enable_kv_cache_reuse with the fused kernel: a prompt sharing two full blocks of 16 with a running one
    prefills only its own tokens and decodes over the shared blocks; both rows' ids equal ``generate``."""
    monkeypatch.setattr(graphs, "FIRST_COLUMNS", 8)
    monkeypatch.setattr(graphs, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(graphs, "ATTENTION", "fused")
    model, reference = _model("llama"), _model("llama")
    engine = Engine(model, Limits(VOCAB, 100, 64), max_rows=3)
    engine.use_graphs("auto", capture=False, reuse=True, blocks=8)
    cache = engine.graphs.cache
    starts = []
    real_admit = cache.admit
    monkeypatch.setattr(cache, "admit", lambda slot, need, prompt=None: starts.append(real_admit(slot, need, prompt))
                        or starts[-1])
    prefix = [(7 * i) % 150 + 3 for i in range(33)]
    first, second = _run(engine, [GenerationRequest(prefix + [40, 41], 6), GenerationRequest(prefix + [50], 9)], late=1)
    assert starts == [0, 32]
    for seq, prompt, n in ((first, prefix + [40, 41], 6), (second, prefix + [50], 9)):
        assert seq.output == _generate(reference, prompt, n), prompt


def test_a_paged_cache_admits_what_it_can_hold_and_no_request_waits_forever(monkeypatch):
    """A pool of exactly one max_seq_len sequence: two requests that may each reach it run one after the other
    (the second waits for the first's blocks, then gets its answer); a pool smaller than one sequence is
    refused at load with the reason, and a request larger than a pool (as tests can make one) fails at once
    with a clear error instead of waiting."""
    monkeypatch.setattr(graphs, "BLOCK_TOKENS", 4)
    engine = Engine(_model("llama"), Limits(VOCAB, 40, 40), max_rows=2)
    with pytest.raises(ValueError, match="holds 9 blocks of 4 tokens, fewer than one 40-token sequence needs"):
        engine.use_graphs("auto", capture=False, paged="true", blocks=9)
    engine.use_graphs("auto", capture=False, paged="true", blocks=10)
    updates = []
    seqs = [Sequence(GenerationRequest([1, 2, 3], 37), lambda s, u: updates.append(u)) for _ in range(2)]
    engine.submit(seqs)
    engine.run_until_idle()
    assert [len(s.output) for s in seqs] == [37, 37] and seqs[0].output == seqs[1].output
    assert [u.reason for u in updates if u.finished] == ["length", "length"]
    small = Engine(_model("llama"), Limits(VOCAB, 40, 40), max_rows=2)
    small.use_graphs("auto", capture=False, paged="true", blocks=10)
    small.graphs.cache.blocks = 5  # as if the pool were smaller than a sequence
    failed = []
    small.submit([Sequence(GenerationRequest([1, 2, 3], 30), lambda s, u: failed.append(u))])
    small.run_until_idle()
    assert failed[-1].reason == "error" and "may reach 33 tokens, more than the paged KV cache holds (5 blocks" \
        in failed[-1].error


def _overlap_run(model, requests, overlap: str, *, late: int = 0, cancel_at: int | None = None, rows: int = 3):
    """Run ``requests`` through a static-slot engine (``-o overlap_steps``); the last ``late`` join after four
    steps; request 0 is cancelled after ``cancel_at`` steps. Returns (sequences, updates per sequence,
    steps launched ahead)."""
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=rows, cancel_check_ms=0)  # checked every step
    engine.use_graphs("auto", capture=False, overlap=overlap)
    updates: dict[int, list] = {}
    seqs = [Sequence(r, lambda s, u: updates.setdefault(id(s), []).append(u)) for r in requests]
    ahead = 0
    real = engine._decode_ahead

    def counted():
        nonlocal ahead
        ahead += engine._ahead is not None  # a step launched while the one before is still unread
        real()

    engine._decode_ahead = counted
    engine.submit(seqs[:len(seqs) - late])
    with torch.inference_mode():
        for step in range(4):
            if cancel_at == step:
                seqs[0].cancel()
            engine.step()
    engine.submit(seqs[len(seqs) - late:])
    engine.run_until_idle()
    assert engine._ahead is None and not engine._active
    return seqs, [updates.get(id(s), []) for s in seqs], ahead


def test_finished_rows_leave_holes_the_last_rows_fill():
    """When rows finish, the rows past the new end move into their slots (the others stay where they are): every
    layer's keys and values of the moved slots in one gather, their columns in use only."""
    from forge.in_triton.python_target.forge_decoder.engine import filled_holes
    from forge.in_triton.python_target.forge_decoder.kvlayout import StaticSlots

    assert filled_holes([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert filled_holes([1, 2, 3]) == [3, 1, 2] and filled_holes([0, 1]) == [0, 1] and filled_holes([]) == []
    cache = StaticSlots(layers=3, rows=6, kv=2, dim=4, max_len=8, dtype=torch.float32, device="cpu")
    for layer in range(3):
        for slot in range(7):
            cache.keys[layer][slot] = 100 * layer + slot
            cache.values[layer][slot] = -(100 * layer + slot)
    before = [t.clone() for t in cache.keys + cache.values]
    cache.keep(filled_holes([0, 2, 3, 5]), used=6, filled=5)
    for layer in range(3):
        for slot, row in enumerate([0, 5, 2, 3]):
            assert (cache.keys[layer][slot, :, :5] == 100 * layer + row).all()
            assert (cache.values[layer][slot, :, :5] == -(100 * layer + row)).all()
        # columns past the filled ones, and the slots past the new end, are not copied
        assert (cache.keys[layer][1, :, 5:] == 100 * layer + 1).all() and (cache.keys[layer][5] == 100 * layer + 5).all()
    assert all(t.data_ptr() == cache.store.data_ptr() + i * t.numel() * t.element_size()
               for i, t in enumerate(cache.keys + cache.values))  # views of the one tensor
    assert sum((a != b).sum().item() for a, b in zip(before, cache.keys + cache.values)) == 2 * 3 * 2 * 5 * 4


def _same_updates(got: list[list], expected: list[list]) -> None:
    """The same updates (tokens, ends, reasons; log-probabilities to float32 noise: a step of another row count)."""
    assert [[(u.tokens, u.finished, u.reason, u.error) for u in row] for row in got] == \
        [[(u.tokens, u.finished, u.reason, u.error) for u in row] for row in expected]
    flat = [lp for row in got for u in row for lp in u.logprobs]
    assert flat == pytest.approx([lp for row in expected for u in row for lp in u.logprobs], abs=1e-4)


def test_overlapped_steps_report_what_one_step_at_a_time_reports(monkeypatch):
    """-o overlap_steps: each step launched before the host reads the one before it (its tokens gathered from
    that step's picks on the device). Run eagerly here (=true): five rows through 3 slots joining late and leaving
    early, one ended by its end_id and one by a stop word (found a step late: the step launched meanwhile is
    dropped for them), one by its max_tokens (padding in the step after), a cancelled one, and a sampled row that
    makes its steps run one at a time. Every sequence's updates equal the engine's without overlap, and the plain
    rows' ids equal transformers. Steps with a streaming row run one at a time."""
    from forge.in_triton.python_target.forge_decoder.request import SamplingParams

    monkeypatch.setattr(graphs, "FIRST_COLUMNS", 8)
    model, reference = _model("llama"), _model("llama")
    prompts = [[5, 17, 30, 4], [9] * 11, [1], list(range(40, 63)), [7, 8, 9, 10, 11, 12, 13]]
    lengths = [12, 5, 20, 9, 15]
    plain = [_generate(reference, p, n) for p, n in zip(prompts, lengths)]
    requests = [GenerationRequest(p, n) for p, n in zip(prompts, lengths)]
    requests[1].end_id = plain[1][4]  # ends at that token (left out, as TensorRT-LLM does) when min_length allows
    requests[2].stop_words = [plain[2][6:8]]  # ends with its eighth token
    seqs, updates, ahead = _overlap_run(model, requests, "true", late=2)
    base, base_updates, none_ahead = _overlap_run(model, [GenerationRequest(**vars(r)) for r in requests], "false",
                                                  late=2)
    assert ahead > 10 and none_ahead == 0
    _same_updates(updates, base_updates)
    assert [s.output for s in seqs] == [plain[0], seqs[1].output, plain[2][:8], plain[3], plain[4]]
    assert 0 < len(seqs[1].output) < lengths[1]
    assert [u[-1].reason for u in updates] == ["length", "end_id", "stop_words", "length", "length"]

    # a cancelled row, and a sampled row beside plain ones (those steps one at a time, then overlapped again)
    requests = [GenerationRequest(p, n) for p, n in zip(prompts, lengths)]
    requests[3].sampling = SamplingParams(top_k=5, temperature=0.8, seed=11)
    requests[3].max_new_tokens = 3
    seqs, updates, ahead = _overlap_run(model, requests, "true", late=2, cancel_at=2)
    _, base_updates, _ = _overlap_run(model, [GenerationRequest(**vars(r)) for r in requests], "false", late=2,
                                      cancel_at=2)
    assert ahead > 5
    _same_updates(updates, base_updates)
    assert updates[0][-1].reason == "cancelled" and len(seqs[0].output) < lengths[0]
    assert [s.output for s in seqs[1:]] == [plain[1], plain[2], seqs[3].output, plain[4]]

    # a streaming row: every step one at a time (the host is the bottleneck there), the same tokens
    requests = [GenerationRequest(p, n, streaming=True) for p, n in zip(prompts[:2], lengths[:2])]
    seqs, updates, ahead = _overlap_run(model, requests, "true")
    assert ahead == 0 and [s.output for s in seqs] == plain[:2]


def test_overlapped_steps_need_static_slots():
    """-o overlap_steps=auto stays off where the steps are not captured (here: a CPU) and with a paged cache;
    =true with a paged cache is an error saying why; a value outside auto/true/false is refused."""
    model = _model("llama")
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=2)
    assert "overlapped" not in engine.use_graphs("auto", capture=False) and not engine.overlap
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=2)
    assert engine.use_graphs("auto", capture=False, overlap="true").endswith("; steps overlapped)") and engine.overlap
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=2)
    with pytest.raises(ValueError, match="overlap_steps=true: the KV cache is paged"):
        engine.use_graphs("auto", capture=False, paged="true", blocks=80, overlap="true")
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=2)
    with pytest.raises(ValueError, match="overlap_steps='sometimes'"):
        engine.use_graphs("auto", capture=False, overlap="sometimes")
    engine = Engine(model, Limits(VOCAB, 100, 128), max_rows=2)
    with pytest.raises(ValueError, match="overlap_steps=true belongs to the CUDA-graph decoder"):
        engine.use_graphs("false", overlap="true")
