"""forge search: ask a served search_text / search_image ensemble and print ranked ids, scores and documents."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ForgeError, UsageError

HELP = "search a served repository's collection by text or image (search_text / search_image)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("query", nargs="?", default=None, metavar="QUERY", help="the text to search for")
    p.add_argument("--image", type=Path, default=None, metavar="FILE", help="search by this image instead")
    p.add_argument("-k", "--top-k", type=int, default=5, help="results to return (default 5)")
    p.add_argument("--url", default="localhost:8000", help="HTTP endpoint host:port (default localhost:8000)")
    p.add_argument("--model", default=None, help="ensemble to ask (default: search_text, or search_image with --image)")
    p.add_argument("--json", action="store_true", help="print the results as json")


def search(url: str, model: str, source: str, value: bytes, k: int) -> list[dict]:
    """Ranked hits of one query: ``{"rank", "id", "score", "document"}``."""
    import numpy as np
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    query = http.InferInput(source, [1, 1], "BYTES")
    query.set_data_from_numpy(np.array([[value]], dtype=object))
    top_k = http.InferInput("top_k", [1, 1], "INT32")
    top_k.set_data_from_numpy(np.array([[k]], dtype=np.int32))
    try:
        result = http.InferenceServerClient(url, network_timeout=120.0).infer(model, [query, top_k])
    except InferenceServerException as exc:
        raise ForgeError(f"{model} at {url}: {exc.message()}") from None
    except OSError as exc:
        raise ForgeError(f"cannot reach a server at {url}: {exc}", hint="start one with 'forge serve REPO'") from None
    ids, scores, documents = (result.as_numpy(n)[0] for n in ("ids", "scores", "documents"))
    return [{"rank": rank, "id": i.decode(), "score": float(s), "document": json.loads(d.decode())}
            for rank, (i, s, d) in enumerate(zip(ids, scores, documents), 1) if i]


def _summary(document) -> str:
    if not isinstance(document, dict):
        return json.dumps(document)
    main = document.get("text") or document.get("image") or ""
    metadata = document.get("metadata")
    return main + (f"  {json.dumps(metadata, ensure_ascii=False)}" if metadata else "")


def run(args: argparse.Namespace) -> int:
    from ..ui import emit_json

    if args.top_k < 1:
        raise UsageError("-k must be at least 1")
    if (args.query is None) == (args.image is None):
        raise UsageError("give a query text or --image FILE (one of them)")
    if args.image is not None:
        try:
            value = args.image.read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read --image {args.image}: {exc.strerror}") from None
        model, source = args.model or "search_image", "image"
    else:
        if not args.query.strip():
            raise UsageError("the query is empty")
        value, model, source = args.query.encode(), args.model or "search_text", "text_input"
    hits = search(args.url, model, source, value, args.top_k)
    if args.json:
        emit_json(hits)
        return 0
    if not hits:
        print("no results (is the collection empty? run 'forge index')")
    for hit in hits:
        print(f"{hit['rank']:>3}  {hit['score']:.4f}  {hit['id']}  {_summary(hit['document'])}")
    return 0
