"""The backend-version profile table: versions, containers, dtype/dims changes, renames, removals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge.errors import UsageError
from forge import profiles
from forge.profiles import RELEASES, Release, add, build, i, o, resolve

DATA = Path(__file__).parent / "data"
TEMPLATES = json.loads((DATA / "tensorrtllm_backend_templates.json").read_text())
# TensorRT-LLM's all_models/llmapi/tensorrt_llm/config.pbtxt as read from the repository (provenance inside)
LLMAPI = json.loads((DATA / "llmapi_releases.json").read_text())
ENGINE_VERSIONS = [v for v in profiles.known() if not resolve(v).llmapi]
LLMAPI_VERSIONS = [v for v in profiles.known() if resolve(v).llmapi]
PLACEHOLDERS = {profiles.LOGITS: "${logits_datatype}", profiles.PROMPT_TABLE: "${prompt_embedding_table_data_type}",
                profiles.ENCODER_FEATURES: "${encoder_input_features_data_type}"}


def tensor(profile, model, name, output=False):
    spec = profile.interface(model)
    found = spec.output(name) if output else spec.input(name)
    assert found is not None, f"{profile.version} {model} has no {'output' if output else 'input'} {name}"
    return found


def ensemble_inputs(profile) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """The ensemble's inputs as forge derives them from the routes: name → (dtype, dims, optional)."""
    result = {}
    for feed, model, name in profiles.routes(profile).feeds:
        t = tensor(profile, model, name)
        result[feed] = (t.dtype, t.feed_dims or t.dims, t.optional)
    return result


def test_required_versions_exist_and_newest_is_default():
    assert {"v0.5.0", "v0.13.0", "v1.0.0", "v1.1.0", "v1.2.0", "v1.2.1", "v1.3.0rc29"} <= set(profiles.known())
    assert resolve(None).version == profiles.NEWEST == profiles.known()[-1] == "v1.3.0rc29"
    assert profiles.known() == sorted(profiles.known(), key=profiles.parse_version)


def test_the_engine_releases_end_at_v1_2_1_and_the_llmapi_layout_follows():
    assert ENGINE_VERSIONS[-1] == "v1.2.1" and LLMAPI_VERSIONS == ["v1.3.0rc29"]
    newest = resolve(None)
    assert newest.llmapi and [m for m, _ in newest.models] == ["tensorrt_llm"]
    assert newest.container is None  # no NGC tritonserver release ships a 1.3 build yet
    assert not resolve("v1.2.1").llmapi and resolve("v1.2.1").has_model("preprocessing")


@pytest.mark.parametrize("version, container", [
    ("v0.5.0", "nvcr.io/nvidia/tritonserver:23.10-trtllm-python-py3"),
    ("v0.13.0", "nvcr.io/nvidia/tritonserver:24.09-trtllm-python-py3"),
    ("v1.0.0", "nvcr.io/nvidia/tritonserver:25.09-trtllm-python-py3"),
    ("v1.1.0", "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"),
    ("v1.2.0", "nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3"),
    ("v1.2.1", "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"),
])
def test_container_tags(version, container):
    assert resolve(version).container == container


@pytest.mark.parametrize("given, version", [
    ("v0.13.0", "v0.13.0"), ("0.13.0", "v0.13.0"), ("24.09", "v0.13.0"), ("25.10", "v1.0.0"),
    ("25.11", "v1.0.0"), ("26.02", "v1.1.0"), ("26.07", "v1.2.1"), ("1.3.0rc29", "v1.3.0rc29"),
    ("latest", "v1.3.0rc29"), ("nvcr.io/nvidia/tritonserver:23.10-trtllm-python-py3", "v0.5.0"),
])
def test_versions_resolve_by_version_or_container_release(given, version):
    assert resolve(given).version == version


def test_unknown_version_is_a_one_line_usage_error_listing_known_ones():
    """Bad input: --backend-version v0.4.0 (no such profile)."""
    with pytest.raises(UsageError) as err:
        resolve("v0.4.0")
    message = str(err.value)
    assert "\n" not in message and "v0.4.0" in message
    for version in ("v0.5.0", "v0.13.0", "v1.0.0"):
        assert version in message


def test_uint32_became_int32_at_v0_7():
    old, new = resolve("v0.6.1"), resolve("v0.7.1")
    for name in ("request_output_len", "end_id", "pad_id", "runtime_top_k", "beam_width", "min_length"):
        assert tensor(old, "tensorrt_llm", name).dtype == "UINT32"
        assert tensor(new, "tensorrt_llm", name).dtype == "INT32"
    assert ensemble_inputs(old)["max_tokens"][0] == "UINT32"
    assert ensemble_inputs(new)["max_tokens"][0] == "INT32"


def test_text_input_dims_changed_at_v0_12():
    assert ensemble_inputs(resolve("v0.11.0"))["text_input"] == ("STRING", (-1,), False)
    assert ensemble_inputs(resolve("v0.12.0"))["text_input"] == ("STRING", (1,), False)
    assert ensemble_inputs(resolve("v0.12.0"))["max_tokens"] == ("INT32", (1,), False)


def test_renamed_tensors():
    v19, v1 = resolve("v0.19.0"), resolve("v1.0.0")
    assert "min_length" in ensemble_inputs(v19) and "random_seed" in ensemble_inputs(v19)
    assert "min_tokens" in ensemble_inputs(v1) and "seed" in ensemble_inputs(v1)
    assert "min_length" not in ensemble_inputs(v1) and "random_seed" not in ensemble_inputs(v1)
    assert tensor(v1, "tensorrt_llm", "seed").dtype == "UINT64"
    assert tensor(v1, "tensorrt_llm_bls", "min_tokens").dtype == "INT32"
    v17 = resolve("v0.17.0")
    assert "return_kv_cache_reuse_stats" in ensemble_inputs(v17)
    assert "return_perf_metrics" in ensemble_inputs(v19) and "return_kv_cache_reuse_stats" not in ensemble_inputs(v19)


def test_removed_and_deprecated_parameters():
    assert resolve("v0.8.0").parameter("preprocessing", "tokenizer_type") is not None
    assert resolve("v0.9.0").parameter("preprocessing", "tokenizer_type") is None
    assert resolve("v0.9.0").parameter("tensorrt_llm", "enable_trt_overlap") is not None
    assert resolve("v0.10.0").parameter("tensorrt_llm", "enable_trt_overlap") is None
    batching_v9 = resolve("v0.9.0").parameter("tensorrt_llm", "gpt_model_type")
    batching_v10 = resolve("v0.10.0").parameter("tensorrt_llm", "gpt_model_type")
    assert "V1" in batching_v9.choices and not batching_v9.deprecated
    assert "V1" in batching_v10.deprecated and batching_v10.name == "batching_strategy"


def test_documented_defaults_change_with_the_version():
    assert resolve("v0.5.0").parameter("tensorrt_llm", "kv_cache_free_gpu_mem_fraction").default == "0.85"
    assert resolve("v0.13.0").parameter("tensorrt_llm", "kv_cache_free_gpu_mem_fraction").default == "0.9"
    assert resolve("v0.13.0").parameter("tensorrt_llm", "enable_kv_cache_reuse").default == "false"
    assert resolve("v1.0.0").parameter("tensorrt_llm", "enable_kv_cache_reuse").default == "true"
    assert resolve("v0.8.0").parameter("preprocessing", "add_special_tokens").default == "false"
    assert resolve("v0.10.0").parameter("preprocessing", "add_special_tokens").default == "true"


def test_bls_appears_at_v0_7():
    assert not resolve("v0.6.1").has_model("tensorrt_llm_bls")
    assert resolve("v0.7.1").has_model("tensorrt_llm_bls")


def test_table_is_consistent():
    """Every route points at a tensor that exists, and one ensemble name never means two dtypes."""
    for profile in profiles.PROFILES.values():
        for model in profiles.MODELS:
            spec = profile.interface(model)
            names = [(t.name, t.output) for t in spec.inputs + spec.outputs]
            assert len(names) == len(set(names)), f"{profile.version} {model} repeats a tensor"
            for t in spec.inputs:
                if t.src:
                    src_model, src_name = t.src.split(".", 1)
                    assert profile.interface(src_model).output(src_name) is not None, (profile.version, t.src)
        feeds = {}
        for feed, model, name in profiles.routes(profile).feeds:
            dtype = tensor(profile, model, name).dtype
            assert feeds.setdefault(feed, dtype) == dtype, (profile.version, feed)


def test_adding_a_version_is_one_table_row():
    row = Release("v9.0.0", "99.01", (add("tensorrt_llm", i("future_flag", "BOOL", 1, opt=True, scalar=True, feed=True),
                                           o("future_output", "INT32", 1, out=True)),))
    table = build(profiles.ENGINE_RELEASES + (row,))
    future = table["v9.0.0"]
    assert future.container == "nvcr.io/nvidia/tritonserver:99.01-trtllm-python-py3"
    assert tensor(future, "tensorrt_llm", "future_flag").feed == "future_flag"
    assert ("tensorrt_llm", "future_output", "future_output") in profiles.routes(future).results
    assert table["v1.0.0"] == profiles.PROFILES["v1.0.0"]


def test_a_bad_row_names_the_version():
    """A row that changes a tensor the previous version lacks fails with the version in the message."""
    with pytest.raises(ValueError, match="v9.0.0"):
        build(RELEASES + (Release("v9.0.0", "99.01", profiles.drop("tensorrt_llm.in.no_such_tensor")),))


# -- the table against the real templates --------------------------------------------------------

def _mine(t) -> list:
    dtype = PLACEHOLDERS.get(t.dtype, t.dtype)
    flags = "" if t.output else ("o" if t.optional else "") + ("r" if t.ragged else "") + \
        ("s" if t.reshape == () else "")
    return [t.name, dtype, list(t.dims)] + ([flags] if flags else [])


def _real(entries) -> dict:
    return {e[0]: e for e in entries}


def _expected(version: str) -> dict:
    """The real templates of ``version``; v1.0.0 is main-2505 plus what TensorRT-LLM's copy added; v1.1.0 kept
    them, v1.2.0 and v1.2.1 made enable_trt_overlap a tensorrt_llm parameter again (engine_templates_after_v1.json)."""
    if version in ("v1.1.0", "v1.2.0", "v1.2.1"):
        base = _expected("v1.0.0")
        if version != "v1.1.0":
            base["tensorrt_llm"]["parameters"] = sorted(base["tensorrt_llm"]["parameters"] + ["enable_trt_overlap"])
        return base
    if version != "v1.0.0":
        return TEMPLATES["versions"][version]
    base = json.loads(json.dumps(TEMPLATES["versions"]["main-2505"]))
    llm, bls, pre = base["tensorrt_llm"], base["tensorrt_llm_bls"], base["preprocessing"]
    for model in (llm, bls):
        model["inputs"] += [["return_num_input_tokens", "BOOL", [1], "os"], ["return_num_output_tokens", "BOOL", [1], "os"]]
        model["outputs"] += [["num_input_tokens", "INT32", [1]], ["num_output_tokens", "INT32", [1]]]
    for entry in llm["inputs"]:
        if entry[0] == "prompt_embedding_table":
            entry[1] = "${prompt_embedding_table_data_type}"
    pre["inputs"].append(["IMAGES", "STRING", [-1], "o"])
    for entry in pre["outputs"]:
        if entry[0] == "IMAGE_SIZES":
            entry[2] = [-1, 2]
    pre["parameters"] = sorted(pre["parameters"] + ["hf_model_path"])
    for entry in base["ensemble"]["inputs"]:
        if entry[0] == "prompt_embedding_table":
            # The template hard-codes FP16 here; forge's ensemble takes the member's dtype, which is
            # FP16 for float16 models (and stays consistent for bfloat16 ones).
            entry[1] = "${prompt_embedding_table_data_type}"
    base["ensemble"]["inputs"] += [["return_num_input_tokens", "BOOL", [1], "o"], ["return_num_output_tokens", "BOOL", [1], "o"]]
    base["ensemble"]["outputs"] += [["num_input_tokens", "INT32", [1]], ["num_output_tokens", "INT32", [1]]]
    for step in base["ensemble"]["steps"]:
        if step[0] == "tensorrt_llm":
            step[1].update(return_num_input_tokens="return_num_input_tokens",
                           return_num_output_tokens="return_num_output_tokens")
            step[2].update(num_input_tokens="num_input_tokens", num_output_tokens="num_output_tokens")
    return base


@pytest.mark.parametrize("version", ENGINE_VERSIONS)
def test_models_match_the_real_templates(version):
    profile, real = resolve(version), _expected(version)
    for model in profiles.MODELS:
        assert profile.has_model(model) == (model in real), (version, model)
        if model not in real:
            continue
        spec = profile.interface(model)
        assert _real(_mine(t) for t in spec.inputs) == _real(real[model]["inputs"]), (version, model)
        assert _real(_mine(t) for t in spec.outputs) == _real(real[model]["outputs"]), (version, model)
        assert sorted(p.key for p in profile.params(model)) == real[model]["parameters"], (version, model)
        assert (model in profile.dynamic_batching) == real[model]["dynamic_batching"], (version, model)


@pytest.mark.parametrize("version", ENGINE_VERSIONS)
def test_ensemble_routes_match_the_real_templates(version):
    profile, real = resolve(version), _expected(version)["ensemble"]
    mine_inputs = {feed: [feed, PLACEHOLDERS.get(d, d), list(dims)] + (["o"] if opt else [])
                   for feed, (d, dims, opt) in ensemble_inputs(profile).items()}
    real_inputs = {e[0]: [e[0], e[1], e[2]] + (["o"] if len(e) > 3 and "o" in e[3] else []) for e in real["inputs"]}
    assert mine_inputs == real_inputs
    routes = profiles.routes(profile)
    mine_outputs = {name: _mine(tensor(profile, model, t, output=True))[1:3] for model, t, name in routes.results}
    assert mine_outputs == {e[0]: e[1:3] for e in real["outputs"]}
    producers = {tensor_name: (model, out) for model, _, outs in real["steps"] for out, tensor_name in outs.items()}
    real_edges = set()
    for model, ins, outs in real["steps"]:
        for name, source in ins.items():
            real_edges.add(("feed", source, model, name) if source in real_inputs
                           else ("link", *producers[source], model, name))
        for name, target in outs.items():
            if target in mine_outputs:
                real_edges.add(("result", model, name, target))
    mine_edges = {("feed", *f) for f in routes.feeds} | {("link", *x) for x in routes.links} | \
        {("result", *r) for r in routes.results}
    assert mine_edges == real_edges


@pytest.mark.parametrize("version", LLMAPI_VERSIONS)
def test_llmapi_model_matches_the_real_template_tensor_by_tensor(version):
    """The LLM-API tensorrt_llm model: every input and output of TensorRT-LLM's llmapi config.pbtxt, by name,
    type, dims and optional, in the same order; nothing else."""
    real = LLMAPI["llmapi_config_newest_stored"]
    spec = resolve(version).interface("tensorrt_llm")
    mine_in = [(t.name, "TYPE_" + t.dtype, list(t.dims), t.optional) for t in spec.inputs]
    mine_out = [(t.name, "TYPE_" + t.dtype, list(t.dims)) for t in spec.outputs]
    assert mine_in == [(e["name"], e["data_type"], e["dims"], e["optional"]) for e in real["inputs"]]
    assert mine_out == [(e["name"], e["data_type"], e["dims"]) for e in real["outputs"]]
    assert not any(t.feed or t.src or t.out for t in spec.inputs + spec.outputs)  # no ensemble to route
