"""CLIP with --store: images and captions in one collection, search_image and search_text on the real tritonserver.

The CLIP here is a tiny random-initialised model (no pretrained CLIP weights exist offline), so an
image finds itself and the text path is checked for wiring, not for meaning.
"""

from __future__ import annotations

import json

import pytest
from encoder_fixtures import built, serving

from forge.cli import main
from forge.encoder.samples import synthetic_image

pytestmark = pytest.mark.heavy


def run_json(*args: str):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_image_finds_itself_and_captions_share_the_collection(hf_clip_model, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for seed in range(4):
        (images / f"img{seed}.png").write_bytes(synthetic_image(80 + seed * 10, 64, seed=seed))
    captions = tmp_path / "captions.jsonl"
    captions.write_text(json.dumps({"id": "cap0", "text": "a red square", "metadata": {"image": "img0.png"}}) + "\n")
    repo = built(tmp_path / "repo", "--family", "clip", "--model", str(hf_clip_model), "--target", "python",
                 "--dtype", "float32", "--store", str(tmp_path / "clip.db"))
    assert {"search_text", "search_image", "clip_text", "clip_image"} <= {p.name for p in repo.iterdir()}
    assert run_json("index", str(repo), str(images))["indexed"] == 4
    assert run_json("index", str(repo), str(captions))["indexed"] == 1
    with serving(repo) as (server, _):
        url = server.http_url
        hits = run_json("search", "--image", str(images / "img2.png"), "--url", url, "-k", "5")
        assert hits[0]["id"] == "img2.png" and hits[0]["score"] > 0.999
        assert hits[0]["document"]["image"] == str((images / "img2.png").resolve())
        assert len(hits) == 5 and "cap0" in {h["id"] for h in hits}
        texts = run_json("search", "a red square", "--url", url, "-k", "1")
        assert texts[0]["id"] == "cap0" and texts[0]["score"] > 0.999
