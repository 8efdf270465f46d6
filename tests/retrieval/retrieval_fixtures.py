"""The small real corpus of the retrieval tests, its queries, and forge index / search run in-process."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from pathlib import Path

from forge.cli import main

CORPUS = [
    {"id": "eiffel", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France.",
     "metadata": {"topic": "travel"}},
    {"id": "photo", "text": "Photosynthesis converts light energy into chemical energy in plants."},
    {"id": "rates", "text": "The stock market fell sharply after the central bank raised interest rates."},
    {"id": "cookies", "text": "A recipe for chocolate chip cookies needs butter, sugar and flour."},
    {"id": "python", "text": "Python is a popular programming language for machine learning."},
    {"id": "reef", "text": "The Great Barrier Reef is the largest coral reef system in the world."},
]
#: a query and a paraphrase of it → the document both must find first
QUERIES = [("Where is the Eiffel Tower?", "Which city has the famous iron tower?", "eiffel"),
           ("How do plants make food from sunlight?", "green leaves turn light into sugar", "photo"),
           ("What do I need to bake cookies?", "ingredients for a sweet biscuit", "cookies")]


def search(url: str, query: str, k: int = 3) -> list[dict]:
    """``forge search --json`` against the server at ``url``: the ranked hits."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["search", query, "--url", url, "-k", str(k), "--json"]) == 0
    return json.loads(out.getvalue())


def index(*args: str) -> dict:
    """``forge index ARGS --json``: its report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["index", *args, "--json"]) == 0
    return json.loads(out.getvalue())


def _reusable_bind(port: int):
    """The milvus package's port check, with SO_REUSEADDR: the port of a stopped server stays in TIME_WAIT."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        return sock
    except OSError:
        sock.close()
        return None


def milvus_server(data: Path):
    """A started Milvus standalone server (the PyPI package ``milvus``) keeping its data in ``data``; it can be
    stopped and started again on its port."""
    import milvus

    server = milvus.MilvusServer(data_dir=str(data))
    server.config.try_bind_port = _reusable_bind
    server.start()
    return server
