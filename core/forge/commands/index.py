"""forge index: embed a corpus through a repository's encoder and write it to the vector store."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "embed a corpus (.txt, .jsonl, a folder of images) with a repository's encoder into its vector store"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", type=Path, metavar="REPO", help="a repository built with --store")
    p.add_argument("corpus", type=Path, metavar="CORPUS",
                   help=".txt (one document per line), .jsonl (text, optional id and metadata) or an image folder")
    p.add_argument("--store", default=None, metavar="URI", help="vector store (default: the repository's); "
                   "the token comes from MILVUS_TOKEN")
    p.add_argument("--collection", default=None, metavar="NAME", help="collection (default: the repository's)")
    p.add_argument("--url", default=None, metavar="HOST:PORT",
                   help="a running server of REPO to embed with (default: start one for the run)")
    p.add_argument("--batch-size", type=int, default=256, help="documents per write (default 256)")
    p.add_argument("--json", action="store_true", help="print the report as json")


def run(args: argparse.Namespace) -> int:
    from ..retrieval.indexer import index
    from ..ui import Progress, emit_json

    report = index(args.repo, args.corpus, uri=args.store, collection=args.collection, url=args.url,
                   batch_size=args.batch_size, log=Progress(quiet=args.json), quiet=args.json)
    if args.json:
        emit_json(report)
    else:
        rate = f", {report['indexed'] / report['seconds']:.1f} documents/s" if report['indexed'] else ""
        print(f"{report['collection']} in {report['store']}: {report['indexed']} indexed, {report['unchanged']} "
              f"unchanged ({report['documents']} documents, dim {report['dim']}, {report['index']} index{rate})")
    return 0
