"""The ``forge`` command line. Sub-commands live in ``forge.commands``; heavy imports stay inside them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Sequence

# numpy's OpenBLAS starts one thread per core at import and each busy-waits (sched_yield) for
# about 2^28 cycles before sleeping: ~0.1 s of CPU per forge command on a 2-core machine, though
# export and most commands make no BLAS call. 2^4 cycles lets them sleep at once; a later BLAS call
# wakes them (same matmul speed, measured). Set before numpy loads; a user's own setting wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from . import __version__  # noqa: E402 (after the environment above, before anything imports numpy)
from .errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, ForgeError

# name → module in forge.commands; each module has HELP, add_arguments(parser), run(args) -> int
COMMANDS = ("build", "export", "plugins", "options", "validate", "doctor", "serve", "infer", "bench", "index",
            "search", "deploy")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"forge: error: {message} (see '{self.prog} --help')\n")


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` just that sub-command (its module alone is imported:
    a command's start-up does not pay for every other command's imports)."""
    top = _Parser(prog="forge", description="Build, serve and measure Triton model repositories "
                  "from Hugging Face checkpoints.")
    top.add_argument("--version", action="version", version=f"forge {__version__}")
    top.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in (only,) if only in COMMANDS else COMMANDS:
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
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser(_command(argv)).parse_args(argv)
    except SystemExit as exc:  # --help, --version, argument errors: keep main() returning codes
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except ForgeError as exc:  # a plugin failed to load while build's parser read the families' flags
        if "--debug" in argv or os.environ.get("FORGE_DEBUG"):
            raise
        print(f"forge: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
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
    except BrokenPipeError:  # the reader of our output went away (`forge … | head`): as before, the interpreter's way
        raise
    except OSError as exc:  # the system refused something (a full or failing disk, a permission): one line too
        if debug:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"forge: error: {where}{exc.strerror or exc}{_in_cache(exc.filename)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("forge: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _in_cache(filename: object) -> str:
    """A note for a path inside forge's cache, where stages write before their output moves to --out."""
    if not isinstance(filename, (str, os.PathLike)):
        return ""
    from .cache import CACHE_ENV, cache_dir

    try:
        Path(filename).resolve().relative_to(cache_dir().resolve())
    except (ValueError, OSError):
        return ""
    return f" (in forge's cache, where outputs are made before they move to --out; ${CACHE_ENV} sets it)"


def _command(argv: Sequence[str]) -> str | None:
    """The sub-command named in ``argv`` (None for top-level options such as --help or --version)."""
    for arg in argv:
        if arg == "--debug":
            continue
        return arg if arg in COMMANDS else None
    return None


def run() -> None:
    """Console-script entry point."""
    if "numpy" not in sys.modules:
        sys.meta_path.insert(0, _DeferredNumpyParts())
    _exit(main())


class _DeferredNumpyParts:
    """Loads numpy's optional subpackages when first used, not when numpy is imported.

    numpy 1.x imports numpy.random, numpy.ma, numpy.polynomial, numpy.fft and numpy.ctypeslib as
    it starts: ~25 ms of every command (measured), though of forge's commands only ``bench`` uses
    one (numpy.random). In the command-line process (not where forge is imported as a library) they
    load through ``importlib.util.LazyLoader`` instead: the same modules, executed on their first
    attribute access. Python before 3.12.3 does not guard that first access against two threads at
    once; forge's own threads use none of these modules.
    """

    NAMES = frozenset({"numpy.random", "numpy.ma", "numpy.polynomial", "numpy.fft", "numpy.ctypeslib"})

    def find_spec(self, name: str, path: Sequence[str] | None, target: object = None):
        if name not in self.NAMES:
            return None
        from importlib import machinery, util

        spec = machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, machinery.SourceFileLoader):
            spec.loader = util.LazyLoader(spec.loader)
        return spec


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown once the command is done.

    Freeing numpy's and forge's modules at exit takes ~25 ms (measured), part of every command's
    time. Exit handlers run and the standard streams are flushed first; with another thread still
    alive, or a stream that cannot be flushed, the normal exit runs instead.
    """
    import atexit
    import threading

    if threading.active_count() > 1:
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (a closed pipe: let the interpreter report it its own way)
        sys.exit(code)
    os._exit(code)
