"""Fixtures of the retrieval tests: the encoder fixtures plus the built-in retrieval stage."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "encoders"))

from encoder_fixtures import *  # noqa: E402,F401,F403
from retrieval_fixtures import CORPUS  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def encoder_environment(encoder_cache):
    """Isolated cache; the encoder plugins and the retrieval stage only; few threads."""
    import forge_clip
    import forge_minilm
    import torch

    import forge.retrieval
    from forge.testing import use_plugins

    torch.set_num_threads(2)
    with pytest.MonkeyPatch.context() as patch, \
            use_plugins(("clip", forge_clip.plugin), ("minilm", forge_minilm.plugin),
                        ("retrieval", forge.retrieval.plugin)):
        patch.setenv("FORGE_CACHE_DIR", str(encoder_cache))
        patch.delenv("MILVUS_TOKEN", raising=False)
        yield


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """The corpus as a .jsonl file."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    return path
