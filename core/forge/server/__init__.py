"""The server forge runs: how a repository launches, the tritonserver process, its supervisor and the serve session."""
