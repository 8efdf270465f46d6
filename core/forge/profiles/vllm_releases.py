"""Triton's vLLM backend (``triton-inference-server/vllm_backend``) releases as data: the model's tensors.

The backend is a python-based backend named ``vllm``: a model is ``config.pbtxt`` with ``backend: "vllm"``
(decoupled, no batch dimension) and ``1/model.json`` holding vLLM's engine arguments. Its tensors are the
ones the backend's ``auto_complete_config`` declares in ``src/model.py`` of each release branch; forge writes
them all into ``config.pbtxt`` (forge's tritonserver runs with auto-completion off). Each row lists what the
release added; the newest row is the default, and the NGC container of a release is
``nvcr.io/nvidia/tritonserver:<release>-vllm-python-py3``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

#: (name, Triton dtype, dims, optional) of each input and output
Tensor = tuple[str, str, tuple[int, ...], bool]


@dataclass(frozen=True)
class VllmRelease:
    """One release of the vLLM backend: what it added to the interface of the release before it."""

    version: str  # the Triton release (the backend's branch r<version>)
    inputs: tuple[Tensor, ...] = ()
    outputs: tuple[Tensor, ...] = ()

    @property
    def container(self) -> str:
        return f"nvcr.io/nvidia/tritonserver:{self.version}-vllm-python-py3"


ROWS = (
    VllmRelease("24.08",
                inputs=(("text_input", "STRING", (1,), False), ("stream", "BOOL", (1,), True),
                        ("sampling_parameters", "STRING", (1,), True),
                        ("exclude_input_in_output", "BOOL", (1,), True)),
                outputs=(("text_output", "STRING", (-1,), False),)),
    VllmRelease("25.01",
                inputs=(("image", "STRING", (-1,), True),
                        *((f"return_{n}", "BOOL", (1,), True) for n in (
                            "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                            "num_output_tokens"))),
                outputs=(("finish_reason", "STRING", (-1,), False), ("cumulative_logprob", "FP32", (-1,), False),
                         ("logprobs", "STRING", (-1,), False), ("num_input_tokens", "UINT32", (1,), False),
                         ("num_output_tokens", "UINT32", (-1,), False))),
    # embedding_request: reserved for Triton's OpenAI front (pooling models); generators answer it with an error
    VllmRelease("25.12", inputs=(("embedding_request", "STRING", (1,), True),)),
    VllmRelease("26.01"),
)

NEWEST = ROWS[-1].version
#: the order of the image input in the backend's own declaration (after text_input)
_ORDER = ("text_input", "image", "stream", "sampling_parameters", "exclude_input_in_output")


@dataclass(frozen=True)
class VllmInterface:
    version: str
    container: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def interface(version: str | None = None) -> VllmInterface:
    """The complete interface of ``version`` (default: the newest release), rows folded from the oldest."""
    wanted = (version or NEWEST).removeprefix("r").removeprefix("v")
    if wanted not in [r.version for r in ROWS]:
        raise UsageError(f"--backend-version {version} is not a release of Triton's vLLM backend forge knows",
                         hint=f"choose one of {', '.join(r.version for r in ROWS)} (default {NEWEST})")
    inputs: list[Tensor] = []
    outputs: list[Tensor] = []
    for row in ROWS:
        inputs += row.inputs
        outputs += row.outputs
        if row.version == wanted:
            break
    inputs.sort(key=lambda t: _ORDER.index(t[0]) if t[0] in _ORDER else len(_ORDER))
    release = next(r for r in ROWS if r.version == wanted)
    return VllmInterface(wanted, release.container, tuple(inputs), tuple(outputs))
