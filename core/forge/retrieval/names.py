"""The names the retrieval stage gives its family, model, ensembles and default collection."""

FAMILY = "retrieval"
RETRIEVER = "retriever"
SEARCH_TEXT = "search_text"
SEARCH_IMAGE = "search_image"
DEFAULT_COLLECTION = "documents"
