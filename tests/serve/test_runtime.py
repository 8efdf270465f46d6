"""The python target's runtime without Triton: request checks, sampling, continuous batching, responses."""

from __future__ import annotations

import numpy as np
import pytest

from forge.in_triton.python_target.forge_decoder import request as rq
from forge.in_triton.python_target.forge_decoder.responses import OutputSpec, RowResult, assemble

LIMITS = rq.Limits(vocab_size=100, max_input_len=16, max_seq_len=32)


def tensors(ids=(1, 2, 3), out=5, **extra):
    t = {"input_ids": np.array([list(ids)], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
         "request_output_len": np.array([[out]], np.int32)}
    t.update({k: np.asarray(v) for k, v in extra.items()})
    return t


def parse(t, decoupled=False):
    return rq.parse(t, LIMITS, decoupled=decoupled)


# -- request checks -------------------------------------------------------------------------------

def test_defaults_are_tensorrt_llm_defaults():
    (req,) = parse(tensors())
    assert req.prompt == [1, 2, 3] and req.max_new_tokens == 5
    assert req.sampling.greedy and req.end_id is None and not req.exclude_input


@pytest.mark.parametrize("extra, message", [
    (dict(out=0), "request_output_len must be at least 1"),  # max tokens ≤ 0
    (dict(out=-3), "request_output_len must be at least 1"),
    (dict(ids=tuple(range(1, 18)), out=1), "more than this model's max_input_len 16"),  # prompt too long
    (dict(ids=(1, 2, -4)), "negative token id -4"),  # token id below the vocabulary
    (dict(ids=(1, 2, 103), prompt_embedding_table=np.ones((1, 2, 4), np.float16)),
     "with a prompt table of 2 rows ids must be below 102"),  # past the prompt table
    (dict(ids=(1, 101), prompt_embedding_table=np.ones((1, 3, 4), np.float16), prompt_vocab_size=np.array([[1]])),
     "with a prompt table of 1 rows ids must be below 101"),  # prompt_vocab_size limits the table
    (dict(decoder_input_ids=np.array([[5, 6]], np.int32), decoder_input_lengths=np.array([[2]], np.int32)),
     "decoder_input_ids is the decoder prompt of encoder-decoder models"),
    (dict(beam_width=np.array([[2]])), "beam_width 2 is not supported"),
    (dict(num_return_sequences=np.array([[3]])), "num_return_sequences 3 is not supported"),
    (dict(runtime_top_p=np.array([[1.5]], np.float32)), "runtime_top_p must be in [0, 1]"),
    (dict(runtime_top_k=np.array([[-1]])), "runtime_top_k must be ≥ 0"),
    (dict(temperature=np.array([[-0.5]], np.float32)), "temperature must be ≥ 0"),
    (dict(repetition_penalty=np.array([[0.0]], np.float32)), "repetition_penalty must be > 0"),
    (dict(streaming=np.array([[True]])), "streaming needs a decoupled model"),
    (dict(embedding_bias=np.ones((1, 7), np.float32)), "embedding_bias has 7 values"),
    (dict(guided_decoding_guide=np.array([[b"x"]], object)), "'guided_decoding_guide' is not supported"),
    (dict(stop_words_list=np.array([[[5, 6], [3, -1]]], np.int32)), "invalid offset 3"),
])
def test_bad_requests_get_one_clear_error(extra, message):
    """Bad requests: max tokens ≤ 0 or beyond the limit, prompt too long, out-of-vocab ids, unsupported inputs."""
    ids = extra.pop("ids", (1, 2, 3))
    out = extra.pop("out", 5)
    with pytest.raises(rq.RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(tensors(ids, out, **extra))


def test_output_len_beyond_max_seq_len_is_shortened_with_a_warning_as_tensorrt_llm_does():
    warnings = []
    (req,) = rq.parse(tensors(out=30), LIMITS, decoupled=False, warn=warnings.append)
    assert req.max_new_tokens == 29
    assert warnings == ["prompt length + requested output tokens (3 + 30) exceeds the maximum sequence length (32); "
                        "requested output tokens changed to 29"]


def test_ids_past_the_vocabulary_are_served_and_select_prompt_table_rows():
    """tensorrtllm_backend's benchmark_core_model.py token-norm-dist sends ids in [0, 2**31 - 1)."""
    (plain,) = parse(tensors(ids=(1, 2**31 - 2)))
    assert plain.prompt == [1, 2**31 - 2] and plain.prompt_table is None
    table = np.arange(24, dtype=np.float16).reshape(1, 3, 8)
    (tuned,) = rq.parse(tensors(ids=(100, 5, 102), prompt_embedding_table=table, prompt_vocab_size=np.array([[3]])),
                        rq.Limits(vocab_size=100, max_input_len=16, max_seq_len=32, hidden_size=8), decoupled=False)
    assert tuned.prompt_table.shape == (3, 8) and tuned.prompt_table.dtype == np.float32
    with pytest.raises(rq.RequestError, match="rows have 8 values; this model's hidden size is 4"):
        rq.parse(tensors(ids=(100,), prompt_embedding_table=table),
                 rq.Limits(vocab_size=100, max_input_len=16, max_seq_len=32, hidden_size=4), decoupled=False)


def test_the_preprocessing_placeholders_of_tensorrtllm_backend_are_accepted():
    """v0.13.0+ preprocessing sends one pad token as decoder_input_ids, empty bias and word lists."""
    t = tensors(decoder_input_ids=np.array([[2]], np.int32), decoder_input_lengths=np.array([[1]], np.int32),
                embedding_bias=np.empty((1, 0), np.float32), bad_words_list=np.zeros((1, 2, 1), np.int32) - [[[0], [1]]],
                prompt_table_extra_ids=np.zeros((1, 3), np.uint64))
    (req,) = parse(t)
    assert req.embedding_bias is None and req.bad_words == []


def test_empty_prompt_is_refused():
    """Bad request: empty prompt (input_lengths 0)."""
    t = tensors()
    t["input_lengths"] = np.array([[0]], np.int32)
    with pytest.raises(rq.RequestError, match="the prompt is empty"):
        parse(t)


def test_input_lengths_beyond_input_ids_is_refused():
    """Bad request: input_lengths larger than the tokens sent (wrong shapes)."""
    t = tensors()
    t["input_lengths"] = np.array([[9]], np.int32)
    with pytest.raises(rq.RequestError, match="exceeds the 3 tokens"):
        parse(t)


def test_inputs_it_cannot_honour_are_accepted_when_empty_or_zero():
    t = tensors(prompt_embedding_table=np.zeros((1, 0, 4), np.float16),
                guided_decoding_guide=np.array([[b""]], object))
    assert len(parse(t)) == 1


def test_word_lists_and_per_request_parameters():
    t = tensors(stop_words_list=np.array([[[7, 8, 9, 0], [2, 3, -1, -1]]], np.int32),
                bad_words_list=np.array([[[4, 0], [1, -1]]], np.int32),
                runtime_top_k=np.array([[5]], np.uint32), runtime_top_p=np.array([[0.9]], np.float32),
                temperature=np.array([[0.7]], np.float32), random_seed=np.array([[2**63 + 5]], np.uint64),
                end_id=np.array([[50]], np.int32), min_tokens=np.array([[3]], np.int32),
                exclude_input_in_output=np.array([[True]]), embedding_bias=np.zeros((1, 100), np.float32))
    (req,) = parse(t)
    assert req.stop_words == [[7, 8], [9]] and req.bad_words == [[4]]
    s = req.sampling
    assert (s.top_k, round(s.top_p, 3), round(s.temperature, 3), s.seed, s.min_length) == (5, 0.9, 0.7, 2**63 + 5, 3)
    assert not s.greedy and req.end_id == 50 and req.exclude_input and req.embedding_bias.shape == (100,)


def test_batched_request_gives_one_row_each():
    t = {"input_ids": np.array([[1, 2, 3], [4, 5, 0]], np.int32), "input_lengths": np.array([[3], [2]], np.int32),
         "request_output_len": np.array([[4], [6]], np.uint32)}
    rows = parse(t)
    assert [r.prompt for r in rows] == [[1, 2, 3], [4, 5]]
    assert [r.max_new_tokens for r in rows] == [4, 6] and [r.batch_index for r in rows] == [0, 1]


def test_stop_requests_are_recognised():
    assert rq.is_stop({"stop": np.array([[True]])}) and not rq.is_stop({"stop": np.array([[False]])})


# -- responses --------------------------------------------------------------------------------------

def test_responses_have_the_backend_shapes_and_configured_dtypes():
    specs = {"output_ids": OutputSpec(np.dtype(np.int32), 2), "sequence_length": OutputSpec(np.dtype(np.int32), 1),
             "cum_log_probs": OutputSpec(np.dtype(np.float32), 1),
             "output_log_probs": OutputSpec(np.dtype(np.float32), 2),
             "generation_logits": OutputSpec(np.dtype(np.float32), 3),
             "kv_cache_reused_blocks": OutputSpec(np.dtype(np.int32), 1)}
    rows = [RowResult([1, 2, 3, 9], [-0.5], -0.5, True, batch_index=0),
            RowResult([4, 9, 8], [-1.0, -2.0], -3.0, True, batch_index=1)]
    out = assemble(rows, specs, pad_id=7)
    assert out["output_ids"].dtype == np.int32 and out["output_ids"].tolist() == [[[1, 2, 3, 9]], [[4, 9, 8, 7]]]
    assert out["sequence_length"].tolist() == [[4], [3]]
    assert out["cum_log_probs"].tolist() == [[-0.5], [-3.0]]
    assert out["output_log_probs"].tolist() == [[[-0.5, 0.0]], [[-1.0, -2.0]]]
    assert out["generation_logits"].shape == (2, 1, 1, 1)
    assert "kv_cache_reused_blocks" not in out  # not measured here: absent, never a zero that looks measured


def test_a_rank_whose_teardown_did_not_finish_leaves_at_once_with_status_0(tmp_path):
    """After a process-group teardown that did not finish (a thread still inside it), a rank leaves without its
    interpreter's teardown, which would abort it (std::terminate): exit status 0, what it printed flushed, no
    teardown code run — here an atexit hook and a non-daemon thread that would otherwise keep it alive."""
    import subprocess
    import sys
    from pathlib import Path

    import forge.in_triton.python_target as runtime

    script = tmp_path / "rank.py"
    script.write_text(
        "import atexit, sys, threading, time\n"
        f"sys.path.insert(0, {str(Path(runtime.__file__).parent)!r})\n"
        "from forge_decoder import ranks\n"
        "atexit.register(lambda: print('interpreter teardown ran', flush=True))\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('stopped after 3 steps', end='')\n"
        "ranks.leave_now()\n"
        "print('not reached')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "stopped after 3 steps"), done.stderr


def test_the_commands_of_every_step_and_admission_travel_as_tensors_and_come_back_equal():
    """Rank 0's per-step and per-admission commands pack into a header and an int64 table that the followers
    unpack to the same command; anything else (adapters, context logits, prompt tables, shared prefixes, setup)
    is sent pickled."""
    torch = pytest.importorskip("torch")
    from forge.in_triton.python_target.forge_decoder import ranks

    ids = torch.tensor([[5, 6, 7], [8, 9, 0]], dtype=torch.int32)
    plain = {"lengths": [3, 2], "needs": [40, 41], "banned": [2, -1], "all_logits": False, "modules": False,
             "prompts": None}

    def round_trip(cmd):
        header, table = ranks._pack(cmd)
        assert header[0] != 0 and len(header) == ranks.HEADER
        rows = table if table is not None else torch.zeros((0, 1), dtype=torch.long)
        assert rows.dtype == torch.long and list(rows.shape[:1]) == [header[1]] and rows.shape[1] == header[2]
        return ranks._unpack(header[0], rows)

    back = round_trip(ranks.Command("gprefill", ids=ids, settings=plain))
    assert back.op == "gprefill" and back.ids.tolist() == ids.tolist()
    assert back.settings == {"lengths": [3, 2], "needs": [40, 41], "banned": [2, -1]}
    for rows in ([], [0, 2, 1]):
        assert round_trip(ranks.Command("gkeep", rows=rows)).rows == rows
    for op in ("gstep", "gafter"):
        back = round_trip(ranks.Command(op, ids=torch.tensor([[4], [1]]), positions=torch.tensor([[9], [3]])))
        assert (back.op, back.ids[:, 0].tolist(), back.positions[:, 0].tolist()) == (op, [4, 1], [9, 3])
    back = round_trip(ranks.Command("decode", ids=torch.tensor([[4]]), positions=torch.tensor([[2]]),
                                mask=torch.tensor([[1, 1, 0]])))
    assert (back.ids.tolist(), back.positions.tolist(), back.mask.tolist()) == ([[4]], [[2]], [[1, 1, 0]])

    pickled = [ranks.Command("gprefill", ids=ids, settings={**plain, "all_logits": True}),
               ranks.Command("gprefill", ids=ids, settings={**plain, "modules": True}),
               ranks.Command("gprefill", ids=ids, settings={**plain, "prompts": [[5, 6, 7], [8, 9]]}),
               ranks.Command("gprefill", ids=ids, embeds=torch.zeros(2, 3, 4), settings=plain),
               ranks.Command("gprefill", ids=ids, settings={"lengths": [3, 2]}),
               ranks.Command("gprefill", ids=ids, settings={**plain, "unknown": 1}),
               ranks.Command("graphs", settings={"rows": 2}), ranks.Command("greset"), ranks.Command("stop")]
    for cmd in pickled:
        assert ranks._pack(cmd) == ([0, 0, 0], None), cmd


def test_commands_sent_by_rank_0_arrive_equal_at_a_follower_over_gloo(tmp_path):
    """Two real processes in a gloo group: a step, two slot moves deferred to ride with the next command, a
    prefill that fits one message and one whose table does not (header and table then travel apart), and
    pickled commands arrive as sent, in order."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    import forge.in_triton.python_target as runtime

    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {str(Path(runtime.__file__).parent)!r})\n"
        "from forge_decoder import ranks\n"
        "torch.set_num_threads(1)\n"
        "group = ranks.join(2)\n"
        "big = ranks.MESSAGE // 8\n"
        "def prefill(n, w):\n"
        "    return ranks.Command('gprefill', ids=torch.arange(n * w).view(n, w), settings={'lengths': [w] * n,\n"
        "        'needs': list(range(n)), 'banned': [-1] * n})\n"
        "sent = [ranks.Command('gafter', ids=torch.tensor([[1], [0]]), positions=torch.tensor([[7], [5]])),\n"
        "        ranks.Command('gkeep', rows=[1, 0]), ranks.Command('gkeep', rows=[]), prefill(2, 3),\n"
        "        prefill(big, 8), ranks.Command('graphs', settings={'rows': 4}), ranks.Command('stop')]\n"
        "def show(c):\n"
        "    return (c.op, None if c.ids is None else c.ids.tolist(), None if c.positions is None else\n"
        "            c.positions.tolist(), c.rows, sorted(c.settings.items()))\n"
        "if group.rank == 0:\n"
        "    for c in sent: group.send(c, defer=c.op == 'gkeep')\n"
        "    print(group.pickled, group.broadcasts)\n"
        "else:\n"
        "    got = [group.receive() for _ in sent]\n"
        "    print('EQUAL' if [show(c) for c in got] == [show(c) for c in sent] else [show(c) for c in got])\n"
        "group.close()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMPI_COMM_WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "OMPI_COMM_WORLD_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    out = [r.communicate(timeout=120) for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0], [o[1][-1500:] for o in out]
    # graphs and stop went pickled, nothing else; the slot moves rode with the small prefill, the big prefill's
    # table went apart: 6 broadcasts besides the pickled ones
    assert out[0][0].split() == ["2", "6"], out[0]
    assert out[1][0].split() == ["EQUAL"], out[1][0][-2000:]



def test_a_process_in_a_sibling_repository_whose_name_starts_alike_is_not_counted(tmp_path):
    """``repository_processes(repo)`` (what a stopped server must not leave, and the leftovers ``forge serve``
    refuses to start over) names processes working in ``repo`` and below, not in ``repo-2`` or ``repository``
    beside it."""
    import subprocess
    import sys

    from forge.server.processes import repository_processes

    repo, sibling = tmp_path / "p", tmp_path / "plain"
    (repo / "m").mkdir(parents=True)
    sibling.mkdir()
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=cwd)
               for cwd in (sibling, repo / "m")]
    try:
        assert repository_processes(repo) == [workers[1].pid]
        assert repository_processes(sibling) == [workers[0].pid]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def test_what_started_forge_serve_is_not_a_process_of_the_repository(tmp_path):
    """A wrapper naming the repository (``timeout 600 forge serve REPO``, a shell working in it), even one that
    became init's child, is not an earlier server's leftover: the server it started would refuse to start."""
    import subprocess
    import sys
    import time

    repo, out = tmp_path / "repo", tmp_path / "out.txt"
    repo.mkdir()
    probe = ("import sys; from pathlib import Path; from forge.server.processes import leftover_processes, "
             "repository_processes; r = Path(sys.argv[1]); print(repository_processes(r), leftover_processes(r))")
    wrapper = tmp_path / "wrapper.sh"  # run as "sh wrapper.sh REPO OUT" in REPO: it names the repository twice
    wrapper.write_text(f'sleep 0.5\ncd "$1"\n"{sys.executable}" -c "{probe}" "$1" > "$2"\n')
    # setsid's shell exits at once: the wrapper is then the child of init (or of the nearest subreaper)
    subprocess.run(["setsid", "sh", "-c", f'sh "{wrapper}" "{repo}" "{out}" & exit 0'], check=True, timeout=30)
    deadline = time.monotonic() + 60
    while not (out.is_file() and out.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert out.read_text().split() == ["[]", "[]"]
