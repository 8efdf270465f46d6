"""forge's python-based Triton backend named ``vllm``: ``model.py`` (in the python stub) and the vLLM engine
process it starts (``forge_vllm_engine.py``, run by the vLLM environment's Python), speaking ``forge_vllm_wire``."""
