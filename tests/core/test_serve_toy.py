"""The toy repository runs on the real tritonserver (the core's end-to-end smoke test)."""

from __future__ import annotations

import numpy as np
import pytest

from forge.cli import main

pytestmark = pytest.mark.heavy


def test_toy_ensemble_answers_on_tritonserver(toy, toy_model, tmp_path):
    import tritonclient.http as http

    from forge.server.triton_server import TritonServer

    out = tmp_path / "repo"
    assert main(["build", "--family", "toy", "--model", str(toy_model), "--out", str(out)]) == 0
    with TritonServer(out) as server:
        client = http.InferenceServerClient(server.http_url)
        data = http.InferInput("input", [2, 3], "FP32")
        data.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
        result = client.infer("ensemble", [data]).as_numpy("output")
    np.testing.assert_allclose(result, np.arange(6).reshape(2, 3) * 3.0)


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(toy, toy_model, tmp_path, monkeypatch):
    """Ports of 0 are picked by forge; a port someone binds between the pick and the server's own bind
    (the race that once failed a CI run) makes forge start the server again on fresh ports. A port the
    user asked for is not replaced: that start fails with tritonserver's own words."""
    import socket

    import forge.server.triton_server as server_module
    from forge.errors import ForgeError
    from forge.server.triton_server import TritonServer

    out = tmp_path / "repo"
    assert main(["build", "--family", "toy", "--model", str(toy_model), "--out", str(out)]) == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        real = server_module.free_port
        monkeypatch.setattr(server_module, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
        with TritonServer(out, log_file=tmp_path / "auto.log") as server:
            assert busy not in (server.http_port, server.grpc_port, server.metrics_port)
            assert server.models() and all(m["state"] == "READY" for m in server.models())

        asked = TritonServer(out, grpc_port=busy, log_file=tmp_path / "asked.log")
        with pytest.raises(ForgeError, match="already in use"):
            asked.start()
        assert asked.process.poll() is not None
