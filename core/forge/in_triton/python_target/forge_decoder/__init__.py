"""The python target's runtime, copied into each model directory as the package ``forge_decoder``.

It imports only numpy, torch and transformers (never forge), so a repository runs without forge installed.
"""
