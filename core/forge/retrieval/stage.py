"""The retrieval stage's build hooks: check the store, emit the ``retriever`` model, wire the search ensembles."""

from __future__ import annotations

import os

from .. import in_triton
from .. import tritonconfig as tc
from ..components import Artifact, Component, Edge, TritonModel
from ..context import BuildContext
from ..encoder.adapter import EMBEDDING
from ..encoder.tower_models import IMAGE_INPUT, TEXT_INPUT, encoder_name
from ..errors import UsageError
from ..in_triton.retriever import forge_store
from . import store
from .names import RETRIEVER, SEARCH_IMAGE, SEARCH_TEXT

#: encoder tower role → (search ensemble, its input tensor)
SEARCHES = {"text": (SEARCH_TEXT, TEXT_INPUT), "vision": (SEARCH_IMAGE, IMAGE_INPUT)}
OUTPUTS = (("ids", "STRING"), ("scores", "FP32"), ("documents", "STRING"))


def export(ctx: BuildContext) -> Artifact:
    """No weights: the artifact is the checked store address, recorded in the manifest."""
    uri = store.normalize_uri(str(ctx.option("store")))
    store.check_outside(uri, ctx.spec.out)
    collection = store.check_collection(str(ctx.option("collection", "documents")))
    meta = {"store": uri, "collection": collection, "metric": store.METRIC}
    ctx.note("store", meta)
    return Artifact("retriever", ctx.workdir, meta=meta)


def retriever_model(component: Component, artifact: Artifact, ctx: BuildContext) -> TritonModel:
    meta = artifact.meta
    config = tc.model_config(
        component.model_name(RETRIEVER), backend="python", max_batch_size=ctx.spec.limits.max_batch_size,
        inputs=[tc.model_input(EMBEDDING, "FP32", [-1]), tc.model_input("top_k", "INT32", [1], optional=True)],
        outputs=[tc.model_output(name, dtype, [-1]) for name, dtype in OUTPUTS],
        parameters={"store": meta["store"], "collection": meta["collection"], "metric": meta["metric"],
                    "default_k": int(ctx.option("top_k", 5))},
        instances=1, instance_kind="KIND_CPU", dynamic_batching=True)
    files = {"1/model.py": in_triton.RETRIEVER, "1/forge_store.py": in_triton.STORE, **in_triton.glue_files()}
    return TritonModel(config, files)


def _towers(retriever: Component, components: list[Component], ctx: BuildContext) -> list[Component]:
    """The encoder towers whose embeddings the collection holds (one encoder family)."""
    towers = [c for c in components if c.role in SEARCHES and c.family != retriever.family]
    families = sorted({c.family for c in towers})
    chosen = ctx.option("search_family")
    if not families:
        raise UsageError("--store adds retrieval after an encoder; the build has no encoder family",
                         hint="build --family minilm or --family clip with --store")
    if chosen is None and len(families) > 1:
        raise UsageError(f"--store with several encoder families ({', '.join(families)}): say which one the "
                         f"collection holds with -o search_family={families[0]}")
    if chosen is not None and chosen not in families:
        raise UsageError(f"-o search_family={chosen} is not an encoder family of this build "
                         f"({', '.join(families)})")
    return [c for c in towers if c.family == (chosen or families[0])]


def edges(retriever: Component, components: list[Component], models: dict[str, TritonModel],
          ctx: BuildContext) -> list[Edge]:
    """search ensemble = the tower's own pipeline (nested) → retriever → ids, scores, documents."""
    model = retriever.model_name(RETRIEVER)
    result: list[Edge] = []
    dims = set()
    for tower in _towers(retriever, components, ctx):
        name, source = SEARCHES[tower.role]
        ensemble = f"{retriever.prefix}{name}"
        pipeline = tower.ensemble  # the tower's own ensemble, a step of the search ensemble
        result += [Edge.feed(source, pipeline, source, ensemble=ensemble),
                   Edge.link(pipeline, EMBEDDING, model, EMBEDDING, ensemble=ensemble),
                   Edge.feed("top_k", model, "top_k", ensemble=ensemble)]
        result += [Edge.result(model, out, ensemble=ensemble) for out, _ in OUTPUTS]
        encoder = models.get(encoder_name(tower))
        if encoder is not None:
            dims.update(tuple(o.dims) for o in encoder.config.output if o.name == EMBEDDING)
    _check_store(models[model], dims, ctx)
    return result


def _check_store(retriever: TritonModel, dims: set, ctx: BuildContext) -> None:
    """Refuse an encoder whose dimension differs from an existing collection's (when the store answers)."""
    uri = tc.parameter(retriever.config, "store")
    collection = tc.parameter(retriever.config, "collection")
    if len(dims) != 1 or ctx.dry_run:
        return
    (dim,) = next(iter(dims))
    if forge_store.is_lite(uri) and not os.path.isdir(uri):
        return  # a new Lite store: forge index creates it
    try:
        client = forge_store.connect(uri)
    except forge_store.StoreUnavailable as exc:
        ctx.log(f"retrieval: collection not checked ({exc})")
        return
    try:
        store.check_dim(client, uri, collection, dim, "the encoder of this build")
    finally:
        forge_store.release(uri)
