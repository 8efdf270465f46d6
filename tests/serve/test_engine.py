"""The continuous-batching engine against transformers' own generate (no Triton)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from forge.in_triton.python_target.forge_decoder import graphs  # noqa: E402
from forge.in_triton.python_target.forge_decoder.engine import Engine, load_model  # noqa: E402
from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits, SamplingParams  # noqa: E402
from forge.in_triton.python_target.forge_decoder.sequences import Sequence  # noqa: E402

VOCAB = 200


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomize(model, seed):
    """Larger weights than the default init, so greedy continuations vary instead of repeating one token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def _llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    _randomize(LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=False)), 1).save_pretrained(path)
    return path


def _gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    _randomize(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=VOCAB,
                                          bos_token_id=0, eos_token_id=0)), 2).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt2-static", "llama-static"])
def model(request, tmp_path_factory):
    """``*-static``: the same model decoding through graphs.GraphDecoder's static KV cache, run eagerly
    (the arithmetic the GPU captures as CUDA graphs), its columns growing by 8 so steps change width often."""
    path = tmp_path_factory.mktemp(request.param)
    (_gpt2 if request.param.startswith("gpt2") else _llama)(path)
    model = load_model(path, torch.device("cpu"), torch.float32)
    model.static_decode = request.param.endswith("-static")
    if model.static_decode:
        patch = pytest.MonkeyPatch()
        patch.setattr(graphs, "EAGER_COLUMNS", 8)
        request.addfinalizer(patch.undo)
    return model


def engine_for(model, limits=None, **kwargs) -> Engine:
    engine = Engine(model, limits or Limits(VOCAB, 100, 128), **kwargs)
    if model.static_decode:
        assert engine.use_graphs("auto", capture=False).startswith("static KV cache")
    return engine


def hf_greedy(model, prompt, n):
    """transformers' greedy continuation of exactly ``n`` tokens (no end-of-sequence stop)."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Collector:
    def __init__(self):
        self.updates = {}

    def __call__(self, seq, update):
        self.updates.setdefault(id(seq), []).append(update)

    def tokens(self, seq):
        return [t for u in self.updates[id(seq)] for t in u.tokens]

    def reason(self, seq):
        return self.updates[id(seq)][-1].reason


def run(model, requests, max_rows=8, join_after=None):
    """Generate ``requests``; with ``join_after`` = (k, steps) the last k join after that many steps."""
    engine = engine_for(model, max_rows=max_rows)
    collect = Collector()
    seqs = [Sequence(r, collect) for r in requests]
    if join_after:
        k, steps = join_after
        engine.submit(seqs[:-k])
        for _ in range(steps):
            engine.step()
        engine.submit(seqs[-k:])
    else:
        engine.submit(seqs)
    engine.run_until_idle()
    return collect, seqs


PROMPTS = [[5, 17, 30, 4], [9] * 11, [1], list(range(40, 63)), [7, 8, 9, 10, 11, 12, 13]]
LENGTHS = [12, 5, 20, 9, 15]


def test_mixed_lengths_joining_mid_flight_equal_transformers_generate(model):
    """Continuous batching: different prompt/output lengths, 3 slots, late joiners; greedy = HF generate."""
    collect, seqs = run(model, [GenerationRequest(p, n) for p, n in zip(PROMPTS, LENGTHS)],
                        max_rows=3, join_after=(2, 4))
    for seq, prompt, n in zip(seqs, PROMPTS, LENGTHS):
        assert collect.tokens(seq) == hf_greedy(model, prompt, n)
        assert collect.reason(seq) == "length"


def test_end_id_stops_and_is_left_out_of_the_output(model):
    reference = hf_greedy(model, PROMPTS[0], 12)
    stop_at = next(i for i, t in enumerate(reference) if i and t not in reference[:i])
    end = reference[stop_at]
    collect, (seq,) = run(model, [GenerationRequest(PROMPTS[0], 12, end_id=end)])
    assert collect.tokens(seq) == reference[:stop_at] and collect.reason(seq) == "end_id"


def test_min_length_holds_back_the_end_id(model):
    reference = hf_greedy(model, PROMPTS[0], 12)
    end = reference[0]
    collect, (seq,) = run(model, [GenerationRequest(PROMPTS[0], 6, end_id=end,
                                                    sampling=SamplingParams(min_length=4))])
    assert end not in collect.tokens(seq)[:4] and len(collect.tokens(seq)) >= 4


def test_stop_words_end_generation_and_stay_in_the_output(model):
    reference = hf_greedy(model, PROMPTS[3], 8)
    word = reference[2:4]
    end = next(i for i in range(2, 8) if reference[i - 1: i + 1] == word) + 1
    collect, (seq,) = run(model, [GenerationRequest(PROMPTS[3], 8, stop_words=[[123, 124], word])])
    assert collect.tokens(seq) == reference[:end] and collect.reason(seq) == "stop_words"


def test_bad_words_are_never_generated(model):
    reference = hf_greedy(model, PROMPTS[2], 6)
    collect, (seq,) = run(model, [GenerationRequest(PROMPTS[2], 6, bad_words=[[reference[0]]])])
    assert reference[0] not in collect.tokens(seq)


def test_seeds_reproduce_tokens_whatever_is_batched_alongside(model):
    sampled = SamplingParams(top_k=20, temperature=1.5, seed=7)
    alone, (seq,) = run(model, [GenerationRequest(PROMPTS[0], 10, sampling=sampled)])
    mixed, seqs = run(model, [GenerationRequest(PROMPTS[3], 10, sampling=SamplingParams(top_p=0.9, seed=1)),
                              GenerationRequest(PROMPTS[0], 10, sampling=SamplingParams(top_k=20, temperature=1.5,
                                                                                       seed=7))])
    assert alone.tokens(seq) == mixed.tokens(seqs[1])
    other, (seq2,) = run(model, [GenerationRequest(PROMPTS[0], 10, sampling=SamplingParams(top_k=20, temperature=1.5,
                                                                                          seed=8))])
    assert other.tokens(seq2) != alone.tokens(seq)
    assert alone.tokens(seq) != hf_greedy(model, PROMPTS[0], 10)


def test_top_k_one_is_greedy_and_penalties_change_the_output(model):
    greedy = hf_greedy(model, PROMPTS[1], 12)
    collect, (a, b) = run(model, [GenerationRequest(PROMPTS[1], 12, sampling=SamplingParams(top_k=1, seed=3)),
                                  GenerationRequest(PROMPTS[1], 12, sampling=SamplingParams(repetition_penalty=5.0,
                                                                                            presence_penalty=3.0))])
    assert collect.tokens(a) == greedy
    assert collect.tokens(b) != greedy and 9 not in collect.tokens(b)[:3]


def test_log_probs_and_logits_match_transformers(model):
    req = GenerationRequest(PROMPTS[0], 4, return_log_probs=True, return_context_logits=True,
                            return_generation_logits=True)
    collect, (seq,) = run(model, [req])
    tokens = collect.tokens(seq)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + tokens])).logits[0]
    n = len(PROMPTS[0])
    assert torch.allclose(torch.from_numpy(seq.context_logits), logits[:n], atol=1e-4)
    generation = torch.stack([torch.from_numpy(g) for u in collect.updates[id(seq)] for g in u.generation_logits])
    assert torch.allclose(generation, logits[n - 1: n - 1 + len(tokens)], atol=1e-4)
    expected = torch.log_softmax(logits[n - 1: n - 1 + len(tokens)], -1).gather(1, torch.tensor(tokens)[:, None])
    assert seq.logprobs == pytest.approx(expected.view(-1).tolist(), abs=1e-4)


def test_top_log_probs_are_the_model_s_raw_distribution(model):
    """Prompt and generated log-probs with alternatives (the OpenAI API's logprobs): the model's own log_softmax,
    for a greedy row and for a sampled, penalised one batched beside it, whose processing must not leak in."""
    greedy = GenerationRequest(PROMPTS[0], 5, top_logprobs=3, prompt_logprobs=2)
    sampled = GenerationRequest(PROMPTS[4], 5, top_logprobs=0,
                                sampling=SamplingParams(temperature=0.7, top_k=20, seed=3, repetition_penalty=1.3))
    collect, seqs = run(model, [greedy, sampled])
    for seq, request in zip(seqs, (greedy, sampled)):
        tokens = collect.tokens(seq)
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([request.prompt + tokens])).logits[0].float(), -1)
        n = len(request.prompt)
        assert len(seq.top) == len(tokens) and [p[0][0] for p in seq.top] == tokens
        for i, position in enumerate(seq.top):
            row = expected[n - 1 + i]
            assert position[0][1] == pytest.approx(float(row[tokens[i]]), abs=1e-4)
            assert position[0][2] == 1 + int((row > row[tokens[i]]).sum())
            alternatives = position[1:]
            assert len(alternatives) == request.top_logprobs
            assert [t for t, _, _ in alternatives] == row.topk(request.top_logprobs).indices.tolist()
            assert [r for _, _, r in alternatives] == list(range(1, request.top_logprobs + 1))
    prompt = seqs[0].prompt_top
    assert prompt[0] is None and len(prompt) == len(PROMPTS[0])
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([PROMPTS[0]])).logits[0].float(), -1)
    for i in range(1, len(PROMPTS[0])):
        assert prompt[i][0][0] == PROMPTS[0][i]
        assert prompt[i][0][1] == pytest.approx(float(expected[i - 1, PROMPTS[0][i]]), abs=1e-4)
        assert len(prompt[i]) == 3
    assert seqs[1].prompt_top is None


def test_cancelled_sequences_stop_and_the_others_finish(model):
    engine = engine_for(model, max_rows=4, cancel_check_ms=0)
    collect = Collector()
    keep, drop = (Sequence(GenerationRequest(p, 20), collect) for p in PROMPTS[:2])
    engine.submit([keep, drop])
    for _ in range(3):
        engine.step()
    drop.cancel()
    engine.run_until_idle()
    assert collect.reason(drop) == "cancelled" and len(collect.tokens(drop)) < 20
    assert collect.tokens(keep) == hf_greedy(model, PROMPTS[0], 20)


def test_is_cancelled_callback_is_polled(model):
    engine = engine_for(model, max_rows=4, cancel_check_ms=0)
    collect = Collector()
    flag = {"cancel": False}
    seq = Sequence(GenerationRequest(PROMPTS[0], 30), collect, is_cancelled=lambda: flag["cancel"])
    engine.submit([seq])
    engine.step()
    flag["cancel"] = True
    engine.run_until_idle()
    assert collect.reason(seq) == "cancelled"


def test_a_failing_owner_does_not_stop_the_batch(model):
    collect = Collector()

    def broken(seq, update):
        raise RuntimeError("client went away")

    engine = engine_for(model, max_rows=4, log=lambda m: None)
    good, bad = Sequence(GenerationRequest(PROMPTS[0], 8), collect), Sequence(GenerationRequest(PROMPTS[1], 8), broken)
    engine.submit([good, bad])
    engine.run_until_idle()
    assert collect.tokens(good) == hf_greedy(model, PROMPTS[0], 8)


def test_engine_thread_serves_requests_submitted_while_running(model):
    import threading

    engine = engine_for(model, max_rows=2).start()
    try:
        done = threading.Event()
        results = {}

        def finish(seq, update):
            if update.finished:
                results[id(seq)] = list(seq.output)
                if len(results) == 3:
                    done.set()

        seqs = [Sequence(GenerationRequest(p, n), finish) for p, n in zip(PROMPTS[:3], (6, 9, 4))]
        for seq in seqs:
            engine.submit([seq])
        assert done.wait(60)
    finally:
        engine.stop()
    assert [results[id(s)] for s in seqs] == [hf_greedy(model, p, n) for p, n in zip(PROMPTS[:3], (6, 9, 4))]


def hf_greedy_embeds(model, embeds, n):
    """transformers' greedy continuation of a prompt given as input embeddings [tokens, hidden]."""
    model.generation_config.eos_token_id = None
    out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, -n:].tolist()


def test_ids_past_the_vocabulary_embed_prompt_table_rows_or_zeros(model):
    """ids ≥ vocab: rows of the request's prompt table (TensorRT-LLM prompt tuning), zeros without a table;
    batched with a plain prompt, whose answer must not change."""
    embed = model.get_input_embeddings()
    hidden = embed.embedding_dim
    table = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    tuned, outside, plain = [5, VOCAB + 2, VOCAB, 17], [5, 2**31 - 2, 17], [9, 8, 7]
    collect, seqs = run(model, [GenerationRequest(tuned, 6, prompt_table=table.numpy()),
                                GenerationRequest(outside, 6), GenerationRequest(plain, 6)])
    with torch.no_grad():
        rows = embed(torch.tensor([5, 0, 0, 17]))
        rows[1], rows[2] = table[2], table[0]
        zeros = embed(torch.tensor([5, 0, 17]))
        zeros[1] = 0.0
        assert collect.tokens(seqs[0]) == hf_greedy_embeds(model, rows, 6)
        assert collect.tokens(seqs[1]) == hf_greedy_embeds(model, zeros, 6)
    assert collect.tokens(seqs[2]) == hf_greedy(model, plain, 6)


def test_penalties_ignore_prompt_ids_past_the_vocabulary(model):
    req = GenerationRequest([5, 2**31 - 2, 17], 4, sampling=SamplingParams(repetition_penalty=1.3))
    collect, seqs = run(model, [req])
    assert len(collect.tokens(seqs[0])) == 4 and collect.reason(seqs[0]) == "length"


def test_automatic_runtime_choices_follow_the_device(monkeypatch):
    """-o compute_dtype / cpu_threads / inflight_sequences = auto: what the served model picks per device."""
    from forge.in_triton.python_target.forge_decoder import engine as eng

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(eng, "cpu_has_bf16", lambda: False)
    assert eng.choose_dtype(cpu, "auto", "float16") == torch.float32  # no bf16 matmuls: float32
    monkeypatch.setattr(eng, "cpu_has_bf16", lambda: True)
    assert eng.choose_dtype(cpu, "auto", "float16") == torch.bfloat16
    assert eng.choose_dtype(gpu, "auto", "bfloat16") == torch.bfloat16  # a GPU computes in --dtype
    assert eng.choose_dtype(cpu, "float16", "float32") == torch.float16  # -o compute_dtype overrides
    monkeypatch.setattr(eng.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert eng.choose_threads(cpu, 0) == 3 and eng.choose_threads(cpu, 2) == 2  # float32: one core left free
    assert eng.choose_threads(cpu, 0, torch.float32) == 3
    assert eng.choose_threads(cpu, 0, torch.bfloat16) == 4  # native bf16 matmuls: every core
    monkeypatch.setattr(eng, "cpu_has_bf16", lambda: False)
    assert eng.choose_threads(cpu, 0, torch.bfloat16) == 3  # emulated bf16 is memory-bound like float32
    assert eng.choose_rows(cpu, 0, 8) == eng.CPU_ROWS == 32 and eng.choose_rows(cpu, 0, 48) == 48 and eng.choose_rows(gpu, 0, 8) == 64 and eng.choose_rows(gpu, 5, 8) == 5


def test_on_a_gpu_arrivals_are_gathered_into_one_prefill_while_sequences_run(model):
    """With sequences running, a lone arrival waits for others to share its prefill; 16 running admit once
    16 // ADMIT_SHARE are waiting or the oldest waited long enough: ADMIT_WAIT_STEPS decoding steps, or for a
    streamed one (its client watches for the first token) admit_wait_ns; with nothing running it is admitted at
    once. (On a CPU admit_wait_ns is 0: every arrival is admitted at the next step.)"""
    from forge.in_triton.python_target.forge_decoder import scheduler

    engine = engine_for(model, max_rows=32)
    assert engine.admit_wait_ns == 0
    engine.admit_wait_ns = 10**12  # a GPU's gathering, with a wait no test outlives
    running = [Sequence(GenerationRequest([5, 6, 7], 50), lambda s, u: None) for _ in range(16)]
    engine.submit(running)
    engine.step()
    assert len(engine._active) == 16  # nothing ran: admitted at once
    late = [Sequence(GenerationRequest([9, 3], 5), lambda s, u: None) for _ in range(16 // scheduler.ADMIT_SHARE)]
    engine.submit(late[:-1])
    engine.step()
    assert len(engine._active) == 16 and len(engine._pending) == len(late) - 1
    engine.submit(late[-1:])
    engine.step()
    assert len(engine._active) == 16 + len(late) and not engine._pending
    engine.submit([Sequence(GenerationRequest([4], 5), lambda s, u: None)])  # alone: admitted after the steps
    for _ in range(scheduler.ADMIT_WAIT_STEPS):  # ... that many decoding steps ran without it
        engine.step()
        assert len(engine._pending) == 1
    engine.step()
    assert not engine._pending
    engine.submit([Sequence(GenerationRequest([4], 5, streaming=True), lambda s, u: None)])
    engine.step()
    assert len(engine._pending) == 1  # a streamed arrival waits for admit_wait_ns, not for steps
    engine.admit_wait_ns = 1
    engine.step()
    assert not engine._pending


def test_a_model_loaded_apart_serves_and_its_load_errors_reach_the_caller(tmp_path, monkeypatch):
    """``loading.load_apart``: the load runs on a thread of its own that has ended by the time the caller has the
    engine (its torch workers with it), the engine then serves; what the load raised is raised in the caller."""
    import threading

    from forge.in_triton.python_target.forge_decoder import loading

    monkeypatch.setenv("FORGE_PYTARGET_THREADS", "1")
    config = {"parameters": {"max_input_len": {"string_value": "64"}, "max_seq_len": {"string_value": "128"}}}
    with pytest.raises(OSError, match=str(tmp_path / "hf")):  # no checkpoint there
        loading.load_apart(config, tmp_path, print, print, print)
    _llama(tmp_path / "hf")
    loaded = loading.load_apart(config, tmp_path, print, print, print)
    assert not [t for t in threading.enumerate() if t.name.startswith("forge-load")]
    done = threading.Event()
    seq = Sequence(GenerationRequest(prompt=[5, 6, 7], max_new_tokens=4),
                   lambda s, update: done.set() if update.finished else None)
    loaded.engine.start().submit([seq])
    try:
        assert done.wait(60) and len(seq.output) == 4
    finally:
        loaded.engine.stop()
