"""Ensemble assembly and `forge validate`: broken edges are named by both ends."""

from __future__ import annotations

import json

import pytest

from forge import tritonconfig as tc
from forge.cli import main
from forge.components import Edge
from forge.ensemble import assemble, check
from forge.errors import ValidationError
from forge.checks import validate_repository


def _models():
    pre = tc.model_config("pre", backend="python", max_batch_size=4,
                          inputs=[tc.model_input("QUERY", "BYTES", [1]),
                                  tc.model_input("OPT", "INT32", [1], optional=True)],
                          outputs=[tc.model_output("IDS", "INT32", [-1])])
    llm = tc.model_config("llm", backend="python", max_batch_size=4,
                          inputs=[tc.model_input("input_ids", "INT32", [-1])],
                          outputs=[tc.model_output("output_ids", "INT32", [-1, -1])])
    post = tc.model_config("post", backend="python", max_batch_size=4,
                           inputs=[tc.model_input("TOKENS", "INT32", [-1, -1])],
                           outputs=[tc.model_output("TEXT", "BYTES", [-1])])
    return {m.name: m for m in (pre, llm, post)}


EDGES = [Edge.feed("text_input", "pre", "QUERY"), Edge.link("pre", "IDS", "llm", "input_ids"),
         Edge.link("llm", "output_ids", "post", "TOKENS"), Edge.result("post", "TEXT", "text_output")]


def test_assemble_orders_steps_and_names_tensors():
    config = assemble("ensemble", EDGES, _models())
    assert [s.model_name for s in config.ensemble_scheduling.step] == ["pre", "llm", "post"]
    assert [i.name for i in config.input] == ["text_input"]
    assert [o.name for o in config.output] == ["text_output"]
    assert config.max_batch_size == 4
    assert check(config, _models()) == []


@pytest.mark.parametrize("edges, message", [
    ([*EDGES[:1], Edge.link("pre", "IDZ", "llm", "input_ids"), *EDGES[2:]], "'pre' has no output 'IDZ'"),
    ([*EDGES, Edge.feed("x", "ghost", "y")], "names model 'ghost'"),
    ([*EDGES[:1], *EDGES[2:]], "required input llm.input_ids is not fed"),
    ([*EDGES, Edge.feed("again", "llm", "input_ids")], "llm.input_ids is fed twice"),
])
def test_broken_edges(edges, message):
    """Bad inputs tried: unknown tensor, unknown model, unfed input, doubly fed input."""
    with pytest.raises(ValidationError, match=message):
        assemble("ensemble", edges, _models())


def test_dtype_mismatch_names_both_ends():
    models = _models()
    models["llm"].input[0].data_type = tc.dtype("UINT32")
    with pytest.raises(ValidationError, match=r"dtype mismatch pre.IDS \(INT32 \[-1, -1\]\) → llm.input_ids \(UINT32"):
        assemble("ensemble", EDGES, models)


def test_dims_mismatch_and_cycle():
    models = _models()
    models["post"].input[0].dims[:] = [-1]
    with pytest.raises(ValidationError, match="dims mismatch llm.output_ids"):
        assemble("ensemble", EDGES, models)
    loop = [Edge.link("pre", "IDS", "llm", "input_ids"), Edge.link("llm", "output_ids", "post", "TOKENS"),
            Edge.link("post", "TEXT", "pre", "QUERY")]
    with pytest.raises(ValidationError, match="cycle"):
        assemble("ensemble", loop, _models())


def _write_repo(root, models):
    for model in models.values():
        (root / model.name / "1").mkdir(parents=True, exist_ok=True)
        tc.write(model, root / model.name)


def test_validate_clean_and_broken_repositories(tmp_path, capsys):
    models = _models()
    models["ensemble"] = assemble("ensemble", EDGES, models)
    _write_repo(tmp_path, models)
    assert validate_repository(tmp_path) == []
    assert main(["validate", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")

    broken = models["ensemble"]
    broken.ensemble_scheduling.step[1].input_map["input_ids"] = "_nowhere"
    tc.write(broken, tmp_path / "ensemble")
    assert main(["validate", str(tmp_path), "--json"]) == 4
    report = json.loads(capsys.readouterr().out)
    assert any("llm.input_ids reads tensor '_nowhere'" in p for p in report["problems"])


# A hand-written repository in the shape of the tensorrtllm_backend templates (placeholders unfilled).
TEMPLATE = """name: "tensorrt_llm"
backend: "${triton_backend}"
max_batch_size: ${triton_max_batch_size}
model_transaction_policy { decoupled: ${decoupled_mode} }
parameters: { key: "gpt_model_path" value: { string_value: "${engine_dir}" } }
"""


def test_validate_lists_every_placeholder_with_file_and_line(tmp_path, capsys):
    (tmp_path / "tensorrt_llm" / "1").mkdir(parents=True)
    (tmp_path / "tensorrt_llm" / "config.pbtxt").write_text(TEMPLATE)
    assert main(["validate", str(tmp_path)]) == 4
    out = capsys.readouterr().out
    for name, line in (("triton_backend", 2), ("triton_max_batch_size", 3), ("decoupled_mode", 4),
                       ("engine_dir", 5)):
        assert f"${{{name}}} (line {line})" in out
    assert "tensorrt_llm/config.pbtxt" in out


def test_validate_decoupled_mismatch_and_world_size(tmp_path):
    llm = tc.model_config("tensorrt_llm", backend="tensorrtllm", max_batch_size=4,
                          inputs=[tc.model_input("input_ids", "INT32", [-1])],
                          outputs=[tc.model_output("output_ids", "INT32", [-1, -1])],
                          parameters={"gpt_model_path": "1"}, decoupled=True)
    bls = tc.model_config("tensorrt_llm_bls", backend="python", max_batch_size=4,
                          inputs=[tc.model_input("text_input", "BYTES", [1])],
                          outputs=[tc.model_output("text_output", "BYTES", [-1])],
                          parameters={"tensorrt_llm_model_name": "tensorrt_llm"}, decoupled=False)
    _write_repo(tmp_path, {"a": llm, "b": bls})
    (tmp_path / "tensorrt_llm" / "1" / "config.json").write_text(json.dumps(
        {"pretrained_config": {"mapping": {"world_size": 4, "tp_size": 2, "pp_size": 1}}}))
    (tmp_path / "tensorrt_llm" / "1" / "rank0.engine").write_bytes(b"")
    problems = validate_repository(tmp_path)
    assert any("decoupled mode false differs from 'tensorrt_llm' (true)" in p for p in problems)
    assert any("world_size 4 ≠ tp_size 2 × pp_size 1" in p for p in problems)
    assert any("1 rank engine files but tp×pp = 2" in p for p in problems)


def test_validate_unparseable_config(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\nmax_batch_size: "eight"\n')
    (problem,) = validate_repository(tmp_path)
    assert "m/config.pbtxt" in problem and "max_batch_size" in problem


def test_step_mixing_decoupled_and_request_tensors_is_reported():
    """Bad input tried: postprocessing fed by a decoupled model and by the request directly."""
    models = _models()
    models["llm"].model_transaction_policy.decoupled = True
    models["post"].input.append(tc.model_input("SKIP", "BOOL", [1], optional=True))
    edges = [*EDGES, Edge.feed("skip", "post", "SKIP")]
    with pytest.raises(ValidationError, match="step 'post' mixes tensors from different decoupled sources"):
        assemble("ensemble", edges, models)
    assert check(assemble("ensemble", EDGES, models), models) == []
