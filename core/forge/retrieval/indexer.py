"""``forge index``: embed a corpus through a repository's encoder pipelines and write it to the store.

The embedding runs where the repository is served (``--url``), or on a tritonserver started for the
run. Writes are upserts by document id in batches; before any embedding the store is asked which
ids it already holds with the same content hash, so an interrupted run resumes where it stopped and
an unchanged corpus does no work (no server is even started).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .. import tritonconfig as tc
from ..encoder.adapter import EMBEDDING
from ..encoder.tower_models import IMAGE_INPUT, TEXT_INPUT
from ..errors import ForgeError, UsageError
from ..in_triton.retriever import forge_store
from . import corpus, store

MODALITY_OF_INPUT = {TEXT_INPUT: corpus.TEXT, IMAGE_INPUT: corpus.IMAGE}


@dataclass(frozen=True)
class Pipeline:
    """A search ensemble of a repository and the encoder pipeline that is its first step."""

    search: str  # search_text / search_image
    encoder: str  # the nested encoder ensemble: text or image → embedding
    input: str  # text_input or image
    dim: int
    max_batch: int


@dataclass(frozen=True)
class SearchRepository:
    """What a repository built with ``--store`` says about retrieval."""

    store: str
    collection: str
    pipelines: dict[str, Pipeline]  # by modality


def read_repository(repo: Path) -> SearchRepository:
    """The store, collection and search pipelines of ``repo``; refuses repositories built without --store."""
    from ..checks import load_configs

    if not repo.is_dir():
        raise UsageError(f"{repo} is not a directory")
    configs, _, _ = load_configs(repo)
    pipelines: dict[str, Pipeline] = {}
    found: tuple[str, str] | None = None
    for name, config in sorted(configs.items()):
        if config.platform != "ensemble":
            continue
        steps = [s.model_name for s in config.ensemble_scheduling.step]
        retriever = next((configs[s] for s in steps if s in configs and tc.parameter(configs[s], "store")), None)
        source = next((t.name for t in config.input if t.name in MODALITY_OF_INPUT), None)
        encoder = next((s for s in steps if s in configs and configs[s].platform == "ensemble"), None)
        if retriever is None or source is None or encoder is None:
            continue
        found = (tc.parameter(retriever, "store"), tc.parameter(retriever, "collection"))
        dims = [list(o.dims) for o in configs[encoder].output if o.name == EMBEDDING]
        pipelines[MODALITY_OF_INPUT[source]] = Pipeline(name, encoder, source, int(dims[0][-1]) if dims else -1,
                                                        max(1, configs[encoder].max_batch_size))
    if found is None:
        raise UsageError(f"{repo} has no search ensembles", hint="build it with --store URI [--collection NAME]")
    return SearchRepository(found[0], found[1], pipelines)


class Embedder:
    """Embeddings from a served encoder pipeline over HTTP, several requests in flight."""

    def __init__(self, url: str):
        import tritonclient.http as http

        self.http = http
        self.client = http.InferenceServerClient(url, concurrency=4, network_timeout=600.0)
        self.url = url

    def __call__(self, pipeline: Pipeline, payloads: list[str | bytes]) -> np.ndarray:
        from tritonclient.utils import InferenceServerException

        pending = []
        for start in range(0, len(payloads), pipeline.max_batch):
            chunk = payloads[start:start + pipeline.max_batch]
            array = np.array([[p.encode() if isinstance(p, str) else p] for p in chunk], dtype=object)
            tensor = self.http.InferInput(pipeline.input, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            pending.append(self.client.async_infer(pipeline.encoder, [tensor]))
        try:
            return np.concatenate([p.get_result().as_numpy(EMBEDDING) for p in pending]).astype(np.float32)
        except InferenceServerException as exc:
            raise ForgeError(f"{pipeline.encoder} at {self.url} failed: {exc.message()}") from None
        except OSError as exc:
            raise ForgeError(f"cannot reach the server at {self.url}: {exc}",
                             hint="start it with 'forge serve REPO', or leave out --url") from None


@contextlib.contextmanager
def embedder(repo: Path, url: str | None, log: Callable[[str], None]) -> Iterator[Embedder]:
    """An Embedder of the server at ``url``, or of a tritonserver started on ``repo`` for the run."""
    if url:
        yield Embedder(url)
        return
    from ..server.triton_server import TritonServer

    log(f"starting tritonserver on {repo} for the run")
    with TritonServer(repo) as server:
        yield Embedder(server.http_url)


def indexed_hashes(client, collection: str, ids: list[str], chunk: int = 1024) -> dict[str, str]:
    """id → content hash of the documents among ``ids`` the collection already holds.

    Read with Strong consistency: a Milvus server answers by default from a view that may lag the
    last writes (Bounded), so a run right after another would embed again what that one wrote.
    Strong waits for the server's next time tick (~200 ms a query there; nothing on Milvus Lite).
    """
    found: dict[str, str] = {}
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        rows = client.query(collection, filter=f"{forge_store.ID} in {json.dumps(part)}",
                            output_fields=[forge_store.ID, forge_store.CONTENT_HASH], consistency_level="Strong")
        found.update({r[forge_store.ID]: r[forge_store.CONTENT_HASH] for r in rows})
    return found


def _progress(total: int, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), transient=True)
    bar.start()
    bar.add_task("indexing", total=total)
    return bar


def index(repo: Path, source: Path, *, uri: str | None = None, collection: str | None = None,
          url: str | None = None, batch_size: int = 256, log: Callable[[str], None] = lambda m: None,
          quiet: bool = False) -> dict:
    """Index ``source`` into the repository's (or the given) store and collection; returns a report."""
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    target = read_repository(repo)
    uri = store.normalize_uri(uri or target.store)
    name = store.check_collection(collection or target.collection)
    documents = corpus.read(source)
    modalities = sorted({d.modality for d in documents})
    for modality in modalities:
        if modality not in target.pipelines:
            raise UsageError(f"{repo} cannot embed {modality}s (it has no search_{modality} ensemble)",
                             hint="build a clip repository to index images" if modality == corpus.IMAGE else None)
    dims = {target.pipelines[m].dim for m in modalities}
    dim = dims.pop()
    started = time.perf_counter()
    with store.opened(uri) as client:
        try:
            store.check_dim(client, uri, name, dim, f"the encoder of {repo}")
            exists = client.has_collection(name)
            if exists:
                client.load_collection(name)
                held = indexed_hashes(client, name, [d.id for d in documents])
            else:
                held = {}
        except forge_store.StoreUnavailable as exc:
            raise ForgeError(str(exc)) from None
        except ForgeError:
            raise
        except Exception as exc:  # noqa: BLE001 - pymilvus errors of several kinds
            raise store.failure(uri, exc) from None
        todo = [d for d in documents if held.get(d.id) != d.content_hash]
        report = {"store": uri, "collection": name, "documents": len(documents), "indexed": 0,
                  "unchanged": len(documents) - len(todo), "dim": dim, "index": None, "seconds": 0.0}
        if not todo:
            log(f"{name}: all {len(documents)} documents are already indexed; nothing to do")
            report["index"] = store.current_index(client, name)
            return report
        if not exists:
            report["index"] = store.create_collection(client, name, dim, len(documents))
            log(f"created collection {name!r} in {uri}: dim {dim}, {store.METRIC}, {report['index']} index")
        bar = _progress(len(todo), quiet)
        try:
            with embedder(repo, url, log) as embed:
                for start in range(0, len(todo), batch_size):
                    batch = todo[start:start + batch_size]
                    vectors = np.empty((len(batch), dim), dtype=np.float32)
                    for modality in modalities:
                        rows = [i for i, d in enumerate(batch) if d.modality == modality]
                        if rows:
                            vectors[rows] = embed(target.pipelines[modality], [batch[i].payload for i in rows])
                    client.upsert(name, [{forge_store.ID: d.id, forge_store.VECTOR: v.tolist(),
                                          forge_store.DOCUMENT: d.document,
                                          forge_store.CONTENT_HASH: d.content_hash} for d, v in zip(batch, vectors)])
                    report["indexed"] += len(batch)
                    if bar is not None:
                        bar.advance(bar.task_ids[0], len(batch))
                    else:
                        log(f"indexed {report['indexed']}/{len(todo)}")
        finally:
            if bar is not None:
                bar.stop()
        client.flush(name)  # seal what was written: searches of unsealed rows scan them one by one
        total = client.get_collection_stats(name).get("row_count", len(documents))
        grown = store.grow_index(client, name, int(total))
        report["index"] = grown or store.current_index(client, name)
        if grown:
            client.load_collection(name)
        forge_store.settle(client, uri, name)  # return with every segment indexed, not scanned
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report
