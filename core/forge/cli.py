"""The ``forge`` command line. Sub-commands live in ``forge.commands``; heavy imports stay inside them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from . import __version__
from .errors import EXIT_INTERRUPTED, EXIT_USAGE, ForgeError

# name → module in forge.commands; each module has HELP, add_arguments(parser), run(args) -> int
COMMANDS = ("build", "export", "plugins", "options", "validate", "doctor", "serve", "infer", "bench", "index",
            "search", "deploy")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"forge: error: {message} (see '{self.prog} --help')\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="forge", description="Build, serve and measure Triton model repositories "
                  "from Hugging Face checkpoints.")
    top.add_argument("--version", action="version", version=f"forge {__version__}")
    top.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"forge.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"forge.commands.{name}":
                raise
            continue  # command not part of this installation
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks for errors")
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, argument errors: keep main() returning codes
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "_run", None):
        parser().print_help()
        return EXIT_USAGE
    debug = args.debug or bool(os.environ.get("FORGE_DEBUG"))
    try:
        return int(args._run(args) or 0)
    except ForgeError as exc:
        if debug:
            raise
        print(f"forge: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("forge: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
