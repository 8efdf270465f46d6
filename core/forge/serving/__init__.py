"""Running Triton: the tritonserver launcher, clients for infer and bench."""
