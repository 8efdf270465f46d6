"""The one home of code that runs inside tritonserver (python backend); it imports nothing from forge.

Every python model forge writes ships ``forge_glue.py`` (parameters, per-request errors, the request
loop, responses holding only the requested outputs) beside its ``model.py``; decoder text models also
ship ``forge_text.py``. The build imports these files for parity checks, never the other way round.

    decoder/              preprocessing, postprocessing, tensorrt_llm_bls  →  <model>/1/model.py
    python_target/        the python target's tensorrt_llm model (model.py) and its engine (forge_decoder/)
    llmapi_model/         the LLM-API layout's tensorrt_llm model on TensorRT-LLM's LLM API (--target tensorrtllm)
    forge_llmapi.py       the LLM-API interface's requests and responses, shipped with both targets' model
    hf_pipeline.py        --target hf-pipeline: the Hugging Face text-generation pipeline per request
    vllm_backend/         the python-based backend named vllm (--target vllm), placed in tritonserver's backends
    encoder_models/       tokenizer, image preprocessing, ONNX Runtime encoder
    multimodal_encoders/  images → the decoder's prompt table (llava)
    retriever/            the retriever model and forge_store.py (Milvus access, also used by forge index/search)
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
GLUE = HERE / "forge_glue.py"  # shipped as 1/forge_glue.py with every python model
TEXT = HERE / "forge_text.py"  # shipped as 1/forge_text.py with the decoder text models
PREPROCESSING = HERE / "decoder" / "preprocessing.py"
POSTPROCESSING = HERE / "decoder" / "postprocessing.py"
BLS = HERE / "decoder" / "bls.py"
DECODER_MODEL = HERE / "python_target" / "model.py"
DECODER_RUNTIME = HERE / "python_target" / "forge_decoder"  # shipped as 1/forge_decoder/
LLMAPI_MODEL = HERE / "llmapi_model" / "model.py"  # the LLM-API layout's tensorrt_llm model (--target tensorrtllm)
LLMAPI = HERE / "forge_llmapi.py"  # shipped as 1/forge_llmapi.py beside either target's LLM-API model
HF_PIPELINE = HERE / "hf_pipeline.py"  # --target hf-pipeline: the per-request pipeline model
TOKENIZER = HERE / "encoder_models" / "tokenizer.py"
IMAGE = HERE / "encoder_models" / "image.py"
ONNX_ENCODER = HERE / "encoder_models" / "onnx_encoder.py"
MULTIMODAL_ENCODERS = HERE / "multimodal_encoders" / "encoders.py"  # image → the decoder's prompt table
RETRIEVER = HERE / "retriever" / "model.py"
STORE = HERE / "retriever" / "forge_store.py"  # shipped as 1/forge_store.py with the retriever


def glue_files() -> dict[str, bytes]:
    """The files every python model directory carries besides its model.py (contents, not links)."""
    return {"1/forge_glue.py": GLUE.read_bytes()}
