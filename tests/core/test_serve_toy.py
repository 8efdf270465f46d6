"""The toy repository runs on the real tritonserver (the core's end-to-end smoke test)."""

from __future__ import annotations

import numpy as np
import pytest

from forge.cli import main

pytestmark = pytest.mark.heavy


def test_toy_ensemble_answers_on_tritonserver(toy, toy_model, tmp_path):
    import tritonclient.http as http

    from forge.serving.server import TritonServer

    out = tmp_path / "repo"
    assert main(["build", "--family", "toy", "--model", str(toy_model), "--out", str(out)]) == 0
    with TritonServer(out) as server:
        client = http.InferenceServerClient(server.http_url)
        data = http.InferInput("input", [2, 3], "FP32")
        data.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
        result = client.infer("ensemble", [data]).as_numpy("output")
    np.testing.assert_allclose(result, np.arange(6).reshape(2, 3) * 3.0)
