"""forge validate: static checks of a Triton model repository."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import EXIT_INVALID

HELP = "check a Triton model repository (placeholders, ensembles, dtypes, world size)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", type=Path, metavar="REPO")
    p.add_argument("--json", action="store_true", help="print problems as json")


def run(args: argparse.Namespace) -> int:
    from ..ui import emit_json
    from ..checks import validate_repository

    problems = validate_repository(args.repo)
    if args.json:
        emit_json({"repo": str(args.repo), "ok": not problems, "problems": problems})
    else:
        for problem in problems:
            print(problem)
        print(f"{args.repo}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return EXIT_INVALID if problems else 0
