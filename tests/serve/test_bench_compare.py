"""forge bench --compare / --sweep: the same workload against several repositories or running servers.

Repositories are the tiny GPT-2 built with ``--target python`` in two dtypes (float32, bfloat16); each is
served for its turn, one server at a time. The running-server cases use the session's server (see
conftest), where ``ensemble`` and ``s_ensemble`` (decoupled) sit side by side like seed 000's two models.
Bad input is refused in one line with exit code 2, before any server starts, and leaves no plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from forge.cli import main
from serve_models import MAX_INPUT_LEN, MAX_SEQ_LEN

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

PNG = b"\x89PNG\r\n\x1a\n"
PROMPTS = ["prompts", "--prompt", "What is machine learning?", "--prompt", "hello world", "--output-len", "5"]


def _build(model: Path, out: Path, dtype: str) -> Path:
    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(model), "--target", "python", "--dtype", dtype,
            "--out", str(out), "--max-input-len", str(MAX_INPUT_LEN), "--max-seq-len", str(MAX_SEQ_LEN),
            "--max-batch-size", "8"]
    assert main(argv) == 0, f"forge {' '.join(argv)} failed"
    return out


@pytest.fixture(scope="module")
def float32_repo(tiny_gpt2, tmp_path_factory) -> Path:
    return _build(tiny_gpt2, tmp_path_factory.mktemp("compare") / "float32", "float32")


@pytest.fixture(scope="module")
def bfloat16_repo(tiny_gpt2, tmp_path_factory) -> Path:
    return _build(tiny_gpt2, tmp_path_factory.mktemp("compare") / "bfloat16", "bfloat16")


def _dataset(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps(entries))
    return path


SEED_DATASET = [  # tensorrtllm_backend's dataset format: prompt = input + " " + instruction
    {"input": "Machine learning is a field of study.", "instruction": "Summarize:", "output": "A field of study."},
    {"input": "The capital of France is Paris.", "instruction": "Answer:", "output": "Paris."},
    {"input": "hello world", "instruction": "Continue:", "output": "hello world, it is a test of words"},
]


# -- two repositories, one server at a time --------------------------------------------------------

@pytest.mark.heavy
def test_compare_sweep_prints_table_ratios_and_plot(float32_repo, bfloat16_repo, tmp_path, capsys):
    plot = tmp_path / "out" / "compare.png"
    code = main(["bench", "--compare", str(float32_repo), str(bfloat16_repo), "--sweep", "1,2", "--plot", str(plot),
                 "token-norm-dist", "--num-requests", "4", "--input-mean", "8", "--output-mean", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    table = [line.split() for line in lines if line.startswith(("float32 ", "bfloat16 "))]
    assert [(row[0], row[1]) for row in table] == [("float32", "c=1"), ("float32", "c=2"),
                                                   ("bfloat16", "c=1"), ("bfloat16", "c=2")]
    assert all(row[-2] == "1.00×" and row[-1] == "1.00×" for row in table[:2])  # the baseline is the first
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in table)  # req/s, generated tokens/s
    assert "ratios vs float32" in out and "× req/s" in out
    assert f"plot: {plot}" in lines
    assert plot.read_bytes().startswith(PNG)


@pytest.mark.heavy
def test_compare_json_counts_tokens_with_each_repositorys_tokenizer(float32_repo, bfloat16_repo, tmp_path, capsys):
    too_long = {"input": "hello world " * MAX_INPUT_LEN, "instruction": "Summarize:", "output": "no"}
    data = _dataset(tmp_path / "seed.json", SEED_DATASET + [too_long])
    code = main(["bench", "--compare", str(float32_repo), str(bfloat16_repo), "--baseline", "bfloat16",
                 "--request-rate", "20", "--arrivals", "constant", "--json",
                 "dataset", "--dataset", str(data), "--skip-long"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["baseline"] == "bfloat16" and report["arrivals"] == "constant" and report["plot"] is None
    assert report["notes"] == ["1 of 4 dataset requests are longer than a target's max input and were left out "
                               "(--skip-long)"]
    assert report["workload"] == {"name": "dataset", "requests": 3, "op_tokens_per_word": 1.3, "dataset": str(data)}
    for target, repo in zip(report["targets"], (float32_repo, bfloat16_repo)):
        assert target["kind"] == "repository" and target["model"] == "ensemble" and target["inputs"] == "text"
        assert target["max_input_len"] == MAX_INPUT_LEN
        assert target["tokenizer"] == str((repo / "preprocessing" / "1" / "tokenizer").resolve())
    runs = {run["target"]: run for run in report["runs"]}
    assert set(runs) == {"float32", "bfloat16"}
    for run in runs.values():
        assert run["errors"] == 0 and run["succeeded"] == 3 and run["output_tokens"] > 0
        assert run["latency_ms"]["p50"] <= run["latency_ms"]["p90"] <= run["latency_ms"]["p99"]
        assert run["first_token_ms"] is None and run["inter_token_ms"] is None  # not streamed
    assert runs["bfloat16"]["req_per_s_ratio"] == 1.0
    assert runs["float32"]["req_per_s_ratio"] == pytest.approx(
        runs["float32"]["req_per_s"] / runs["bfloat16"]["req_per_s"], rel=0.01)


# -- running servers -------------------------------------------------------------------------------

@pytest.mark.heavy
def test_compare_two_models_of_a_running_server_streaming(server, tiny_gpt2, capsys):
    code = main(["bench", "--compare", f"{server.grpc_url}#s_ensemble", f"{server.grpc_url}#ensemble", "--stream",
                 "--concurrency", "2", "--tokenizer", str(tiny_gpt2), "--json", *PROMPTS, "--num-requests", "4"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    streamed, plain = report["runs"]
    assert streamed["target"] == f"{server.grpc_url}#s_ensemble" and streamed["errors"] == 0
    assert streamed["first_token_ms"]["p50"] <= streamed["latency_ms"]["p50"]
    assert streamed["inter_token_ms"]["p50"] > 0
    assert plain["first_token_ms"] is None and plain["errors"] == 0  # not decoupled: measured without streaming
    assert any("not decoupled" in note for note in report["notes"])
    assert [t["kind"] for t in report["targets"]] == ["server", "server"]


@pytest.mark.heavy
def test_sweep_over_http_rates_against_a_running_server(server, tiny_gpt2, tmp_path, capsys):
    plot = tmp_path / "rates.png"
    data = _dataset(tmp_path / "seed.json", SEED_DATASET)
    code = main(["bench", f"http://{server.http_url}#s_ensemble", "--stream", "--sweep", "rate=10,40",
                 "--tokenizer", str(tiny_gpt2), "--plot", str(plot), "--json", "dataset", "--dataset", str(data)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["protocol"] == "http" and report["arrivals"] == "poisson"
    assert [run["load"] for run in report["runs"]] == ["10/s poisson", "40/s poisson"]
    assert all(run["errors"] == 0 and run["first_token_ms"] for run in report["runs"])
    assert report["plot"] == str(plot) and plot.read_bytes().startswith(PNG)


# -- bad input: one line, exit code 2, no report files ---------------------------------------------

def _refused(capsys, argv: list[str], plot: Path, *needles: str) -> str:
    code = main(["bench", "--plot", str(plot), *argv])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("forge: error: ")
    for needle in needles:
        assert needle in err
    assert not plot.exists() and not list(plot.parent.glob("*.png"))
    return err


def test_unreachable_server_is_refused(float32_repo, tmp_path, capsys):
    _refused(capsys, ["--compare", str(float32_repo), "127.0.0.1:9", "--sweep", *PROMPTS], tmp_path / "p.png",
             "cannot reach a Triton server's gRPC endpoint at 127.0.0.1:9")


def test_dataset_not_in_the_seeds_format_is_refused(float32_repo, tmp_path, capsys):
    plot = tmp_path / "p.png"
    wrong = _dataset(tmp_path / "wrong.json", [{"prompt": "hello", "completion": "world"}])
    _refused(capsys, ["--compare", str(float32_repo), str(float32_repo), "--sweep", "dataset", "--dataset", str(wrong)],
             plot, "not in the seed's format", "entry 1", '"input", "instruction", "output"')
    not_json = tmp_path / "broken.json"
    not_json.write_text("{ nope")
    _refused(capsys, [str(float32_repo), "--sweep", "dataset", "--dataset", str(not_json)], plot, "is not JSON")


def test_prompts_longer_than_the_max_input_are_refused(float32_repo, tmp_path, capsys):
    long_prompt = "hello world " * (MAX_INPUT_LEN * 2)
    _refused(capsys, ["--compare", str(float32_repo), str(float32_repo), "prompts", "--prompt", long_prompt],
             tmp_path / "p.png", f"max input ({MAX_INPUT_LEN} tokens)", "prompts request 1")
    data = _dataset(tmp_path / "long.json", [{"input": long_prompt, "instruction": "Summarize:", "output": "x"}])
    _refused(capsys, ["--compare", str(float32_repo), str(float32_repo), "dataset", "--dataset", str(data)],
             tmp_path / "p.png", "--skip-long")
    _refused(capsys, [str(float32_repo), "token-norm-dist", "--input-mean", str(MAX_INPUT_LEN + 1)],
             tmp_path / "p.png", "--input-mean")


def test_a_repository_that_is_not_a_text_model_is_refused(float32_repo, tmp_path, capsys):
    from forge import tritonconfig as tc

    embedder = tmp_path / "embedder"
    config = tc.model_config("encoder", backend="python", max_batch_size=8,
                             inputs=[tc.model_input("text_input", "STRING", [1])],
                             outputs=[tc.model_output("embedding", "FP32", [384])])
    tc.write(config, embedder / "encoder")
    (embedder / "encoder" / "1").mkdir()
    (embedder / "encoder" / "1" / "model.py").write_text("")
    _refused(capsys, ["--compare", str(float32_repo), str(embedder), *PROMPTS], tmp_path / "p.png",
             f"{embedder} is not a text-generation repository", "embedding")
    _refused(capsys, ["--compare", str(float32_repo), str(float32_repo), "--model", "preprocessing", *PROMPTS],
             tmp_path / "p.png", "'preprocessing'", "not a text-generation model")


def test_other_bad_arguments_are_one_line(float32_repo, tmp_path, capsys):
    plot = tmp_path / "p.png"
    _refused(capsys, [str(float32_repo), str(float32_repo), *PROMPTS], plot, "--compare")
    _refused(capsys, ["--compare", str(float32_repo), str(tmp_path / "missing"), *PROMPTS], plot,
             "neither a model repository")
    _refused(capsys, ["--compare", str(float32_repo), "--baseline", "nope", *PROMPTS], plot, "--baseline nope")
    _refused(capsys, ["--compare", str(float32_repo), "--arrivals", "poisson", *PROMPTS], plot, "--request-rate")
    _refused(capsys, ["--compare", str(float32_repo), "--sweep", "--request-rate", "3", *PROMPTS], plot, "several")
    _refused(capsys, ["--compare", str(float32_repo), *PROMPTS, "--chat-template"], plot, "no chat template")
    _refused(capsys, ["--compare", str(float32_repo), "--plot", str(tmp_path / "p.svg"), *PROMPTS], plot, ".png")


# -- the pieces ------------------------------------------------------------------------------------

def test_seed_dataset_is_read_like_benchmark_core_model(tmp_path):
    from forge.loadgen.runner import read_dataset

    items = read_dataset(_dataset(tmp_path / "seed.json", SEED_DATASET))
    assert [item.text for item in items] == ["Machine learning is a field of study. Summarize:",
                                             "The capital of France is Paris. Answer:", "hello world Continue:"]
    assert [item.output_len for item in items] == [int(4 * 1.3), 1, int(8 * 1.3)]
    assert len(read_dataset(tmp_path / "seed.json", num_requests=2, op_tokens_per_word=2.0)) == 2


def test_echoed_prompts_are_not_counted_as_generated():
    from forge.loadgen.runner import Item, Target
    from forge.clients.inference import ModelInputs

    inputs = ModelInputs("ensemble", {"text_input": ("STRING", [1]), "max_tokens": ("INT32", [1])}, True)
    target = Target(inputs, stream=False, echoes=lambda text: [text.replace("<s>", "")])
    item = Item(4, text="<s>user: hi")
    assert target.generated(item, "<s>user: hi there") == " there"  # the prompt as sent
    assert target.generated(item, "user: hi there") == " there"  # decoded without special tokens
    assert target.generated(item, "only the answer") == "only the answer"  # exclude_input_in_output


def _args(argv: list[str]) -> argparse.Namespace:
    from forge.cli import parser

    return parser().parse_args(["bench", *argv])


@pytest.mark.parametrize("argv, loads", [
    (["R"], ["c=1"]),
    (["R", "--concurrency", "3"], ["c=3"]),
    (["R", "--sweep"], ["c=1", "c=2", "c=4", "c=8"]),
    (["R", "--sweep", "2,6"], ["c=2", "c=6"]),
    (["R", "--concurrency", "1,3"], ["c=1", "c=3"]),
    (["R", "--sweep", "--concurrency", "1,5"], ["c=1", "c=5"]),
    (["R", "--sweep", "rate=2,4.5"], ["2/s poisson", "4.5/s poisson"]),
    (["R", "--request-rate", "2,4", "--arrivals", "constant", "--sweep"], ["2/s constant", "4/s constant"]),
])
def test_load_points(argv, loads):
    from forge.loadgen.targets import loads as load_points

    assert [load.label for load in load_points(_args(argv + ["token-norm-dist"]))] == loads


def test_targets_and_workload_parse_in_any_order():
    args = _args(["--compare", "a", "b", "--sweep", "token-norm-dist", "--num-requests", "3"])
    assert args.compare == ["a", "b"] and args.sweep == "" and args.workload == "token-norm-dist"
    args = _args(["repo", "--concurrency", "2", "--json", "prompts", "--prompt", "hi"])
    assert args.target == ["repo"] and args.concurrency == "2" and args.workload == "prompts" and args.json
    args = _args(["--sweep", "1,2", "--compare", "h:1#m", "dataset", "--dataset", "f.json"])
    assert args.compare == ["h:1#m"] and args.sweep == "1,2" and args.workload == "dataset"
