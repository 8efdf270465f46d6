"""llama export: Llama/Mistral (GQA, MQA) → TensorRT-LLM unified checkpoint (parity, KV duplication, refusals)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_models import hf_logits, make_llama

from forge.cli import main
from forge.llm.reference import ReferenceModel, load_rank, max_abs_diff

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

IDS = [3, 17, 42, 99, 5, 8, 64, 100, 0, 31, 77, 12]


def export(model: Path, out: Path, *args) -> int:
    return main(["export", "--backend-version", ENGINE, "--family", "llama", "--model", str(model), "--out", str(out), *map(str, args)])


def close(got, expected, rel=1e-4) -> bool:
    return max_abs_diff(got, expected) < rel * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gqa_rank_files_reproduce_transformers_logits(tiny_llama, tmp_path, tp, pp):
    """8 heads / 2 KV heads: at tp 4 each KV head is duplicated on two ranks; logits match HF."""
    out = tmp_path / "ckpt"
    assert export(tiny_llama, out, "--tp", tp, "--pp", pp, "--dtype", "float32") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["num_key_value_heads"] == 2
    assert config["position_embedding_type"] == "rope_gpt_neox"
    assert close(ReferenceModel(out).logits(IDS), hf_logits(tiny_llama, IDS))


def test_kv_heads_duplicated_when_fewer_than_tp(tiny_llama, tmp_path):
    """tp 4 over 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1; Q heads split evenly."""
    from safetensors.numpy import load_file

    out = tmp_path / "ckpt"
    assert export(tiny_llama, out, "--tp", 4, "--dtype", "float32") == 0
    hf = load_file(tiny_llama / "model.safetensors")
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    d = 8
    for r in range(4):
        qkv = load_rank(out / f"rank{r}.safetensors")["transformer.layers.1.attention.qkv.weight"]
        assert qkv.shape == (2 * d + 2 * d, 64)
        head = r // 2
        np.testing.assert_array_equal(qkv[: 2 * d], q[r * 2 * d:(r + 1) * 2 * d])
        np.testing.assert_array_equal(qkv[2 * d: 3 * d], k[head * d:(head + 1) * d])
        np.testing.assert_array_equal(qkv[3 * d:], v[head * d:(head + 1) * d])


@pytest.mark.parametrize("variant", ["mqa", "mistral", "biases", "tied", "head_dim"])
def test_variants_reproduce_transformers_logits(tmp_path, variant):
    """MQA (1 KV head), Mistral, attention/MLP biases, tied embeddings, head_dim ≠ hidden/heads at tp 2."""
    kwargs = {"mqa": dict(kv_heads=1), "mistral": dict(arch="mistral"),
              "biases": dict(attention_bias=True, mlp_bias=True),
              "tied": dict(tie_word_embeddings=True), "head_dim": dict(head_dim=16)}[variant]
    model = make_llama(tmp_path / "m", seed=3, **kwargs)
    out = tmp_path / "ckpt"
    assert export(model, out, "--tp", 2, "--pp", 2, "--dtype", "float32") == 0
    assert close(ReferenceModel(out).logits(IDS), hf_logits(model, IDS))
    names = set(load_rank(out / "rank0.safetensors"))
    assert ("transformer.layers.0.attention.qkv.bias" in names) == (variant == "biases")
    assert ("transformer.layers.0.mlp.gate.bias" in names) == (variant == "biases")


def test_half_precision_from_bfloat16_source(tmp_path):
    """A bfloat16 checkpoint exports to float16 and bfloat16 with logits close to float32."""
    import torch
    from safetensors.torch import load_file, save_file

    model = make_llama(tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, model / "model.safetensors",
              metadata={"format": "pt"})
    expected = hf_logits(model, IDS)
    for dtype, rel in (("float16", 1e-2), ("bfloat16", 5e-2), ("float32", 1e-4)):
        out = tmp_path / dtype
        assert export(model, out, "--tp", 2, "--dtype", dtype) == 0
        assert close(ReferenceModel(out).logits(IDS), expected, rel), dtype


def test_rope_scaling_is_carried_into_the_config(tmp_path):
    """transformers 5 rope_parameters (llama3 scaling, theta) become TensorRT-LLM rotary_base/rotary_scaling."""
    model = make_llama(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ckpt"
    assert export(model, out) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["rotary_base"] == 500000.0
    assert written["rotary_scaling"]["type"] == "llama3" and written["rotary_scaling"]["factor"] == 8.0


# -- refusals ----------------------------------------------------------------------------------------

def refused(capsys, out: Path, code: int, *fragments: str) -> None:
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, line
    assert line.startswith("forge: error:")
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists()


def test_refuses_tp_not_multiple_of_fewer_kv_heads(tmp_path, capsys):
    """Bad input: 12 heads, 4 KV heads, tp 6 — KV heads can only be duplicated evenly."""
    model = make_llama(tmp_path / "m", hidden=96, heads=12, kv_heads=4)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--tp", 6), "--tp 6 is not a multiple of the 4 key/value heads")


def test_refuses_kv_heads_not_divisible_by_tp(tmp_path, capsys):
    """Bad input: 12 heads, 6 KV heads, tp 4 — 6 KV heads cannot be split over 4 ranks."""
    model = make_llama(tmp_path / "m", hidden=96, heads=12, kv_heads=6)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--tp", 4), "6 key/value heads cannot be split over --tp 4")


def test_refuses_intermediate_size_not_divisible(tmp_path, capsys):
    """Bad input: intermediate_size 100 cannot be split over tp 8 (heads can)."""
    model = make_llama(tmp_path / "m", inter=100, heads=8, kv_heads=8)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--tp", 8), "intermediate_size 100", "cannot be split over --tp 8")


def test_refuses_mistral_under_gpt_family(tiny_llama, tmp_path, capsys):
    """Bad input: a Llama checkpoint given to --family gpt names the family's supported architectures."""
    out = tmp_path / "out"
    code = main(["export", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_llama), "--out", str(out)])
    refused(capsys, out, code, "'LlamaForCausalLM' is not supported by family 'gpt'", "GPT2LMHeadModel")


def test_refuses_missing_q_proj(tiny_llama, tmp_path, capsys):
    """Bad input: one layer's q_proj is absent; the message names it."""
    from safetensors.numpy import load_file, save_file

    model = shutil.copytree(tiny_llama, tmp_path / "bad")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--tp", 2), "lacks 1 tensor(s)", "model.layers.2.self_attn.q_proj.weight")


def test_refuses_pickle_weights_without_allow_pickle(tiny_llama, tmp_path, capsys):
    """Bad input: pickle-only weights; with --allow-pickle they convert like safetensors."""
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    model.mkdir()
    shutil.copy(tiny_llama / "config.json", model)
    torch.save(load_file(tiny_llama / "model.safetensors"), model / "pytorch_model.bin")
    out = tmp_path / "out"
    refused(capsys, out, export(model, out), "pickle")
    assert export(model, out, "--allow-pickle", "--dtype", "float32") == 0
    assert close(ReferenceModel(out).logits(IDS), hf_logits(tiny_llama, IDS))


@pytest.mark.heavy
def test_smollm2_at_tp3_reproduces_transformers(tmp_path):
    """The real SmolLM2-135M (9 heads, 3 KV heads, tied embeddings) at tp 3: float32 logits match HF."""
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import smollm2

    torch.set_num_threads(2)
    model = smollm2.hf_dir()  # materialized once per user (~40 s), then cached

    ids = AutoTokenizer.from_pretrained(model)("The capital of France is")["input_ids"]
    out = tmp_path / "ckpt"
    assert export(model, out, "--tp", 3, "--dtype", "float32") == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    expected = hf_logits(model, ids)
    got = ReferenceModel(out).logits(ids)
    assert close(got, expected, 1e-5)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def _spy(monkeypatch, module, name: str) -> list:
    """Record the first argument after ``self`` (or the first) of every call of ``module.name``."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(a) or real(*a))
    return calls


def _same_as_through_process(model: Path, tmp_path: Path, monkeypatch, got: Path, tp: int) -> None:
    """The rank files in ``got`` equal those of an export that sends every byte through the converting thread."""
    from forge.llm import transfer

    monkeypatch.setattr(transfer, "_IN_KERNEL", False)
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache-2"))  # not the first export's stage
    assert export(model, tmp_path / "process", "--dtype", "float32", "--tp", str(tp)) == 0
    for rank in range(tp):
        name = f"rank{rank}.safetensors"
        assert (got / name).read_bytes() == (tmp_path / "process" / name).read_bytes()


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
def test_unchanged_bytes_write_the_same_bytes_every_way(tiny_llama, tmp_path, monkeypatch, tp, cores):
    """Unchanged whole rows go file to file in the kernel while a core is free for their check (one lane),
    else the lanes relay them (read once, checked, written), each lane its own files; column slices
    (tp > 1) are always relayed. Every way, the rank files equal the through-process ones; relayed in
    pieces smaller than a row block."""
    import threading

    from forge.llm import rankfile, transfer

    monkeypatch.setattr(transfer, "_CORES", cores)
    monkeypatch.setattr(transfer, "RELAY_BYTES", 1000)  # several pieces per block, rows not a divisor
    copied = _spy(monkeypatch, rankfile.RankWriter, "copy")
    relayed, relay, threads, lock = [], transfer._relay, set(), threading.Lock()
    lanes = min(tp, cores)
    together = threading.Event()  # the lanes share one queue: a free lane could take a tiny model's every job

    def spied(*args):
        with lock:
            relayed.append(args)
            threads.add(threading.get_ident())
            if len(threads) >= lanes:
                together.set()
        together.wait(5)  # each lane's first job waits until every lane has one (or 5 s)
        return relay(*args)

    monkeypatch.setattr(transfer, "_relay", spied)
    assert export(tiny_llama, tmp_path / "lanes", "--dtype", "float32", "--tp", str(tp)) == 0
    assert bool(copied) == (lanes == 1)
    assert bool(relayed) == (tp > 1)  # row-parallel weights are split along columns only at tp > 1
    whole = [rows for _, targets, _, rows, *_ in relayed if all(width == rows.stride for *_, width in targets)]
    assert bool(whole) == (lanes > 1)
    assert len(threads) == (lanes if relayed else 0)  # every lane relayed
    _same_as_through_process(tiny_llama, tmp_path, monkeypatch, tmp_path / "lanes", tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_in_kernel_copies_move_whole_pages(tiny_llama, tmp_path, monkeypatch, tp):
    """The rank file's header is padded so that most copied bytes keep their source's page offsets."""
    from safetensors import safe_open

    from forge.llm import rankfile, transfer

    monkeypatch.setattr(transfer, "_CORES", 1)  # one lane: whole rows are copied in the kernel
    copies: dict[str, list[tuple[int, int]]] = {}
    real_copy = rankfile.RankWriter.copy

    def copy(self, name, byte_offset, src_fd, src_offset, length):
        dst = self.data_start + self.offsets[name] + byte_offset
        copies.setdefault(self.path.name, []).append(((src_offset - dst) % 4096, length))
        return real_copy(self, name, byte_offset, src_fd, src_offset, length)

    monkeypatch.setattr(rankfile.RankWriter, "copy", copy)
    out = tmp_path / "ckpt"
    assert export(tiny_llama, out, "--dtype", "float32", "--tp", str(tp)) == 0
    assert sorted(copies) == [f"rank{r}.safetensors" for r in range(tp)]
    for name, done in copies.items():
        by_residue: dict[int, int] = {}
        for residue, length in done:
            by_residue[residue] = by_residue.get(residue, 0) + length
        assert max(by_residue, key=by_residue.__getitem__) == 0, (name, by_residue)
        with safe_open(out / name, "np") as f:  # the padded header is a valid safetensors header
            assert all(f.get_tensor(k).size for k in f.keys())


def _poison(tiny_llama: Path, tmp_path: Path, name: str, value: float, where=(5, -1)) -> Path:
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "bad"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(model / "model.safetensors")
    tensors[name][where] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("name", ["model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"])
def test_refuses_nan_in_a_relayed_column_slice(tiny_llama, tmp_path, capsys, monkeypatch, value, name, cores):
    """Bad input: a NaN/Inf in a row-parallel weight at --tp 2 (its column slices are relayed by the lanes,
    the whole rows checked by one of them) is refused, and no rank file is left."""
    from forge.llm import transfer

    model = _poison(tiny_llama, tmp_path, name, value)  # in the last rank's columns
    monkeypatch.setattr(transfer, "_CORES", cores)
    relayed = _spy(monkeypatch, transfer, "_relay")
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--dtype", "float32", "--tp", "2"), f"{name} contains NaN or Inf")
    assert relayed, "no column slice was relayed"


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize(("cores", "tp", "name"), [(1, 1, "model.layers.1.self_attn.q_proj.weight"),
                                                   (2, 1, "model.layers.1.self_attn.q_proj.weight"),
                                                   (1, 2, "model.layers.1.self_attn.q_proj.weight"),
                                                   (2, 2, "model.layers.1.self_attn.q_proj.weight"),
                                                   (2, 2, "model.embed_tokens.weight")])
def test_refuses_nan_in_unchanged_whole_rows(tiny_llama, tmp_path, capsys, monkeypatch, value, cores, tp, name):
    """Bad input: a NaN/Inf in a float32 weight exported as float32: copied in the kernel and checked beside
    (one lane: tp 1, or one core), or relayed by the lanes (tp 2 on two cores: q_proj's rows split, the
    embedding on every rank)."""
    from forge.llm import transfer

    model = _poison(tiny_llama, tmp_path, name, value, (3, 4))
    monkeypatch.setattr(transfer, "_CORES", cores)
    given, give = [], transfer.Transfers._give  # what the main thread hands out (the lanes stop at the NaN)
    monkeypatch.setattr(transfer.Transfers, "_give",
                        lambda self, crew, fn, *a: given.append(fn) or give(self, crew, fn, *a))
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--dtype", "float32", "--tp", str(tp)), f"{name} contains NaN or Inf")
    assert (transfer._copy in given) == (min(cores, tp) == 1)


def test_a_lane_that_falls_behind_takes_fewer_jobs(tiny_llama, tmp_path, monkeypatch):
    """At tp 4 on two cores the lanes share one queue: a lane that falls behind (here: the first to start,
    slowed) takes fewer of the jobs, whatever rank files they go to, so the lanes end together (with a lane
    per rank file it would take half); the rank files are those of the through-process export."""
    import threading
    import time

    from forge.llm import transfer

    monkeypatch.setattr(transfer, "_CORES", 2)
    relay, slow, lanes = transfer._relay, [], []

    def relay_spy(*args):
        lane = threading.get_ident()
        slow[:] = slow or [lane]
        lanes.append(lane)
        if lane == slow[0]:
            time.sleep(0.05)
        return relay(*args)

    def paced(self, *args):  # the main thread no faster than the quick lane
        time.sleep(0.01)
        return submit(self, *args)

    monkeypatch.setattr(transfer, "_relay", relay_spy)
    submit = transfer.Transfers.relay
    monkeypatch.setattr(transfer.Transfers, "relay", paced)
    assert export(tiny_llama, tmp_path / "lanes", "--dtype", "float32", "--tp", "4") == 0
    assert len(set(lanes)) == 2 and len(lanes) >= 20
    assert lanes.count(slow[0]) <= len(lanes) // 4, lanes
    _same_as_through_process(tiny_llama, tmp_path, monkeypatch, tmp_path / "lanes", 4)


@pytest.mark.parametrize("slow", ["kernel", "relay"])
def test_tp1_times_both_ways_and_keeps_the_faster(tiny_llama, tmp_path, monkeypatch, capsys, slow):
    """At tp 1 on two cores whole rows can be copied in the kernel (and checked beside) or relayed by two
    lanes, and which is faster depends on the host's phase: the export starts in the kernel, times both after
    TIME_AFTER bytes (half the kernel's bytes, the relay's, the kernel's other half), sends what follows the
    faster way, and times them again after RETIME_BYTES. Here one way is slowed: past the timings, every byte
    goes the other way, and the log says which. The rank file is the through-process one."""
    import time

    from forge.llm import transfer

    monkeypatch.setattr(transfer, "_CORES", 2)
    monkeypatch.setattr(transfer, "PROBE_BYTES", 32 << 10)  # the tiny model is 0.4 MiB
    monkeypatch.setattr(transfer, "TIME_AFTER", 16 << 10)
    monkeypatch.setattr(transfer, "RETIME_BYTES", 32 << 10)

    def slowed(real, size):
        return lambda *a: time.sleep(size(*a) * 5e-6) or real(*a)  # 5 s per MB

    sizes = {"kernel": ("_copy", lambda *a: a[-1][2]), "relay": ("_relay", lambda *a: a[3].count * a[3].stride)}
    name, size = sizes[slow]
    monkeypatch.setattr(transfer, name, slowed(getattr(transfer, name), size))
    went, timings, way, time_ways = [], [], transfer.Transfers._way, transfer.Transfers._time

    def timed(self, size):  # a timing ends where ``rates`` is replaced
        rates = self.rates
        time_ways(self, size)
        if self.rates is not rates:
            timings.append(self.rates)

    monkeypatch.setattr(transfer.Transfers, "_time", timed)
    def chosen(self, size):  # after the call, a timing under way means these bytes were timed
        went.append((way(self, size), bool(self._probe), size))
        return went[-1][0]

    monkeypatch.setattr(transfer.Transfers, "_way", chosen)
    assert export(tiny_llama, tmp_path / "timed", "--dtype", "float32", "--tp", "1") == 0
    fast = transfer.RELAY if slow == "kernel" else transfer.KERNEL
    assert len(timings) >= 2 and all(max(rates, key=rates.__getitem__) == fast for rates in timings), timings
    timing = [size for _, probing, size in went if probing]
    before = list(itertools.takewhile(lambda went: not went[1], went))  # until the first timing
    after = [(way, size) for way, probing, size in went[len(before):] if not probing]
    assert sum(timing) >= len(timings) * 2 * transfer.PROBE_BYTES
    assert before and all(way == transfer.KERNEL for way, *_ in before)
    assert sum(size for *_, size in before) >= transfer.TIME_AFTER
    assert after and all(way == fast for way, _ in after), after
    assert f"unchanged rows went {fast} at the end" in capsys.readouterr().err
    _same_as_through_process(tiny_llama, tmp_path, monkeypatch, tmp_path / "timed", 1)


def test_tp1_keeps_the_kernel_way_where_relaying_is_barely_faster():
    """The kernel way does less work per byte: relaying is chosen only where it timed RELAY_MARGIN times faster."""
    from forge.llm.transfer import KERNEL, RELAY, faster_way

    for relayed, expected in ((1.1, KERNEL), (1.3, RELAY), (0.5, KERNEL)):
        assert faster_way({KERNEL: 1.0, RELAY: relayed}) == expected, relayed


@pytest.mark.parametrize("most", [1, 6, 4096])
def test_relay_survives_short_reads(tiny_llama, tmp_path, monkeypatch, most):
    """A read that returns fewer bytes than asked (allowed of preadv) is continued; the files are the same."""
    from forge.llm import transfer

    monkeypatch.setattr(transfer, "_CORES", 2)
    real = os.preadv
    monkeypatch.setattr(transfer.os, "preadv", lambda fd, buffers, pos: real(fd, [buffers[0][:most]], pos))
    assert export(tiny_llama, tmp_path / "short", "--dtype", "float32", "--tp", "2") == 0
    _same_as_through_process(tiny_llama, tmp_path, monkeypatch, tmp_path / "short", 2)


@pytest.mark.parametrize("cores", [1, 2])
def test_rank_files_are_written_in_bounded_pieces(tiny_llama, tmp_path, monkeypatch, cores):
    """No write to a rank file is longer than WRITE_BYTES (large page-cache writes were slow on this VM), also a
    converted block's (float32 → float16) and a relayed piece's; the files equal the default export's."""
    from forge.llm import rankfile, transfer

    monkeypatch.setattr(transfer, "_CORES", cores)
    for dtype in ("float32", "float16"):
        assert export(tiny_llama, tmp_path / f"default-{dtype}", "--dtype", dtype, "--tp", "2") == 0
    monkeypatch.setattr(rankfile, "WRITE_BYTES", 100)
    real, sizes = os.pwrite, []
    monkeypatch.setattr(rankfile.os, "pwrite", lambda fd, data, pos: sizes.append(len(data)) or real(fd, data, pos))
    for dtype in ("float32", "float16"):
        monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / f"cache-{dtype}"))  # not the first export's stage
        assert export(tiny_llama, tmp_path / f"small-{dtype}", "--dtype", dtype, "--tp", "2") == 0
        for rank in range(2):
            small, default = (tmp_path / f"{way}-{dtype}" / f"rank{rank}.safetensors" for way in ("small", "default"))
            assert small.read_bytes() == default.read_bytes()
    assert sizes and max(sizes) == 100


def test_refuses_a_weight_file_that_ends_early(tiny_llama, tmp_path, capsys, monkeypatch):
    """Bad input: the weight file is cut short while it is read (end of file inside a tensor): one line, no output."""
    from forge.llm import transfer

    monkeypatch.setattr(transfer, "_CORES", 2)
    monkeypatch.setattr(transfer.os, "preadv", lambda fd, buffers, pos: 0)
    out = tmp_path / "out"
    refused(capsys, out, export(tiny_llama, out, "--dtype", "float32", "--tp", "2"),
            "model.safetensors ended inside tensor")


@pytest.mark.parametrize(("files", "expected"), [
    ({"index0": ("1", "48K"), "index2": ("2", "2048K")}, 2 << 20),
    ({"index2": ("2", "512K"), "index3": ("3", "32768K")}, 512 << 10),
    ({"index2": ("2", "64K")}, 256 << 10),  # a piece of at least 256 KiB: fewer system calls
    ({"index2": ("2", "8M")}, 2 << 20),  # at most 2 MiB, the largest measured (4 MiB: erratic here)
    ({"index3": ("3", "32768K")}, 1 << 20),  # no L2 listed: the default
    ({"index2": ("2", "large")}, 1 << 20),  # unreadable size: the default
    ({}, 1 << 20),  # no cache information (not Linux): the default
])
def test_relay_pieces_fit_the_core_cache(tmp_path, files, expected):
    from forge.llm.transfer import core_cache_bytes

    for index, (level, size) in files.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(level + "\n")
        (tmp_path / index / "size").write_text(size + "\n")
    assert core_cache_bytes(tmp_path) == expected


@pytest.mark.parametrize(("cores", "tp", "way"), [(1, 1, "write"), (2, 2, "write"), (1, 1, "copy")])
def test_a_failing_write_is_one_line_and_leaves_nothing(tiny_llama, tmp_path, capsys, monkeypatch, cores, tp, way):
    """Bad input (a disk that fails mid-export, here the fifth write or in-kernel copy to a rank file, the copy
    after part of a block went): wherever it runs (the main thread, a lane), the export stops with one line
    and no output."""
    import errno

    from forge.llm import transfer

    monkeypatch.setattr(transfer, "_CORES", cores)
    name = "pwrite" if way == "write" else "copy_file_range"
    if way == "write" and min(cores, tp) == 1:  # one lane: whole rows would be copied in the kernel, past pwrite
        monkeypatch.setattr(transfer, "_IN_KERNEL", False)
    real, calls = getattr(os, name), []

    def failing(*args):
        calls.append(args)
        if len(calls) == 5:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if way == "copy":  # half a block at a time: the fifth call is inside a block
            args = (*args[:2], max(1, args[2] // 2), *args[3:])
        return real(*args)

    monkeypatch.setattr(transfer.os, name, failing)
    out = tmp_path / "out"
    code = export(tiny_llama, out, "--dtype", "float32", "--tp", tp)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert len(calls) >= 5
    assert code == 1 and re.fullmatch(r"forge: error: /\S+/checkpoint/rank\d\.safetensors: Input/output error "
                                      r"\(in forge's cache, where outputs are made before they move to --out; "
                                      r"\$FORGE_CACHE_DIR sets it\)", line), line
    assert not out.exists()


@pytest.mark.parametrize("tag", ["F16", "BF16", "F32"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-nan"])
def test_nonfinite_finds_a_value_in_any_part(tag, value):
    """The NaN/Inf check reads in parts of _CHECK_ELEMS: a bad value in the last, short part is found (NaN with
    either sign, ±Inf), and finite extremes are not reported."""
    import numpy as np

    from forge.llm.tensorio import _CHECK_ELEMS, NUMPY_TYPES, from_float32, nonfinite

    clean = np.full(2 * _CHECK_ELEMS + 5, 3.0, np.float32)
    clean[::7] = -65504.0  # the float16 extremes: finite
    clean[1::7] = 65504.0
    assert not nonfinite(from_float32(clean, tag) if tag != "F32" else clean, tag)
    bad = clean.copy()
    bad[-2] = -np.float32("nan") if value == "-nan" else np.float32(value)
    data = from_float32(bad, tag) if tag != "F32" else bad
    assert data.dtype == np.dtype(NUMPY_TYPES[tag]) and nonfinite(data, tag)


def test_an_export_loads_neither_openssl_nor_concurrent_futures(tiny_llama, tmp_path):
    """Start-up is part of every export's time: the stage keys hash with CPython's own sha256 (hashlib's
    import loads OpenSSL) and the lanes are plain threads (concurrent.futures imports logging)."""
    import hashlib

    from forge.cache import sha256

    assert sha256(b"forge").hexdigest() == hashlib.sha256(b"forge").hexdigest()
    code = ("import atexit, sys\nfrom forge.cli import run\n"  # as the console script runs
            "atexit.register(lambda: print(sorted(m for m in ('_hashlib', 'concurrent.futures', 'logging')"
            " if m in sys.modules)))\n"
            f"sys.argv = ['forge', 'export', '--backend-version', '{ENGINE}', '--family', 'llama', '--model', {str(tiny_llama)!r}, '--out', "
            f"{str(tmp_path / 'o')!r}, '--tp', '2']\nrun()\n")
    env = {**os.environ, "FORGE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "o" / "rank1.safetensors").is_file()
