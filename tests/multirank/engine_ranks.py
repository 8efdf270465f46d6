"""Run under ``mpirun -n N``: the python target's engine at tp N against tp 1, in one process group.

Rank 0 generates greedily for sequences of different prompt and output lengths (joining the batch at
different steps) with the plain engine on the whole model, then with the tensor-parallel engine while
ranks 1..N-1 follow; it prints ``EQUAL`` when every sequence's ids agree, else both results. DECODER picks
how the tensor-parallel engine decodes: ``hf`` (the Hugging Face forward, default), ``static`` or ``paged``
(the CUDA-graph decoder, eager here, on every rank with its all-reduces; columns in buckets of 8 and blocks
of 4 tokens so caches cross both), ``compiled`` (static, its layers' pieces through ``torch.compile``'s
tracing with the eager backend, the all-reduces between them), or ``overlapped`` (static, each step launched
before the last is read, every rank gathering its tokens from its own picks).
Usage: mpirun -n N python engine_ranks.py RUNTIME_DIR MODEL_DIR [DECODER] (MASTER_ADDR/MASTER_PORT set).
"""

import sys

import torch

sys.path.insert(0, sys.argv[1])
from forge_decoder import distributed, engine, graphs, ranks  # noqa: E402
from forge_decoder.request import GenerationRequest, Limits  # noqa: E402
from forge_decoder.sequences import Sequence  # noqa: E402

PROMPTS = [[5, 9, 13, 40], [7, 3], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
DECODER = sys.argv[3] if len(sys.argv) > 3 else "hf"
graphs.FIRST_COLUMNS, graphs.BLOCK_TOKENS = 8, 4  # every rank: the step's buckets must agree
graphs.COMPILE_BACKEND = "eager"  # traced as on a GPU, without compiling code on a small CPU


def generate(model, make_engine, decoder: str = "hf") -> dict:
    eng = make_engine(model, Limits(1000, 64, 128), max_rows=2)
    if decoder != "hf":
        chosen = eng.use_graphs("auto", capture=False, paged="true" if decoder == "paged" else "false",
                                compile="true" if decoder == "compiled" else "false",
                                overlap="true" if decoder == "overlapped" else "auto")
        layout = "static" if decoder in ("compiled", "overlapped") else decoder
        assert chosen.startswith(f"{layout} KV cache"), chosen  # not the Hugging Face forward after all
        assert ("torch.compile on (eager)" in chosen) == (decoder == "compiled"), chosen
        assert ("steps overlapped" in chosen) == (decoder == "overlapped"), chosen
    pickled = eng.group.pickled if decoder != "hf" else 0
    outputs = {}

    def done(seq, update):
        if update.finished:
            outputs[tuple(seq.request.prompt)] = list(seq.output)

    sequences = [Sequence(GenerationRequest(p, 6 + 3 * i), done) for i, p in enumerate(PROMPTS)]
    eng.submit(sequences[:2])
    eng.step()
    eng.submit(sequences[2:])
    eng.run_until_idle()
    if decoder != "hf":  # every step, prefill and slot move travelled as plain tensors
        assert eng.group.pickled == pickled, (eng.group.pickled, pickled)
    return outputs


def main() -> None:
    weights = sys.argv[2]
    torch.set_num_threads(1)
    rank, size = ranks.world_from_env()
    if rank:
        group = ranks.join(size)
        settings = group.broadcast().settings
        model = distributed.load_shard(settings["weights"], torch.device("cpu"), torch.float32, group)
        distributed.Follower(model, group).run()
        group.close()  # as a served follower does: a process leaving its group up can abort at exit
        return
    whole = engine.load_model(weights, torch.device("cpu"), torch.float32)
    model, make_engine = distributed.lead(size, weights, torch.device("cpu"), torch.float32, 1)
    single = generate(whole, engine.Engine)
    parallel = generate(model, make_engine, DECODER)
    make_engine.keywords["group"].send(ranks.Command("stop"))
    make_engine.keywords["group"].close()
    print("EQUAL" if single == parallel else f"DIFFERENT tp1 {single} tp{size} {parallel}", flush=True)


if __name__ == "__main__":
    main()
