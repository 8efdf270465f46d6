"""forge's built-in retrieval stage: a ``retriever`` model on Milvus and the ``search_text`` / ``search_image`` ensembles.

The stage is a family like any other, registered through the ``forge.plugins`` entry point
``retrieval``; it *joins* a build on ``--store`` (``Family.joins_on``) instead of being named with
``--family``, so the driver never names it. Its one component emits the ``retriever`` python model;
its edges nest the encoder families' own pipelines (``ensemble``/``minilm``, ``clip_text``,
``clip_image``) as the first step of ``search_text`` / ``search_image`` and feed their ``embedding``
to the retriever. ``forge index`` fills the collection, ``forge search`` asks the ensembles.
"""

from forge import hookimpl
from forge.components import Component, Family, Option

from .names import DEFAULT_COLLECTION, FAMILY, RETRIEVER, SEARCH_TEXT


def _store_uri(value) -> str:
    """``--store`` as every reader takes it: a relative Lite path means the same store from any working directory."""
    from .store import normalize_uri

    return normalize_uri(str(value))


OPTIONS = (
    Option("store", "str", "vector store: a Milvus Lite data directory (PATH.db) or a Milvus server URI "
           "(http://host:19530); its token comes from MILVUS_TOKEN, never from the command line", None,
           flag="--store", parse=_store_uri),
    Option("collection", "str", "the Milvus collection searched", DEFAULT_COLLECTION, flag="--collection"),
    Option("search_family", "str", "the encoder family whose embeddings the collection holds "
           "(needed when the build has several)", None),
    Option("top_k", "int", "results per query when a request gives no top_k", 5, minimum=1),
)


def _components(spec) -> list[Component]:
    return [Component(name=f"{spec.name_prefix}{RETRIEVER}", family=FAMILY, role=RETRIEVER, source=spec.model,
                      prefix=spec.name_prefix, ensemble=f"{spec.name_prefix}{SEARCH_TEXT}")]


class RetrievalPlugin:
    """The hooks of the retrieval stage; answers only for its own component."""

    @hookimpl
    def forge_register_families(self, register):
        register(Family(name=FAMILY, kind="retrieval", description="top-k search on Milvus after an encoder "
                        "(joins a build on --store)", architectures=(), targets=("python",),
                        default_target="python", components=_components, options=OPTIONS, joins_on=("store",)))

    @hookimpl
    def forge_export(self, component, ctx):
        if component.family != FAMILY:
            return None
        from . import stage

        return stage.export(ctx)

    @hookimpl
    def forge_emit_config(self, component, artifact, ctx):
        if component.family != FAMILY:
            return None
        from . import stage

        return [stage.retriever_model(component, artifact, ctx)]

    @hookimpl
    def forge_ensemble_edges(self, components, models, ctx):
        mine = [c for c in components if c.family == FAMILY]
        if not mine:
            return None
        from . import stage

        return stage.edges(mine[0], components, models, ctx)


#: The object the ``forge.plugins`` entry point ``retrieval = forge.retrieval:plugin`` loads.
plugin = RetrievalPlugin()
