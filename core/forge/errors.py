"""User-facing errors and their stable exit codes."""

from __future__ import annotations

# Exit codes are part of the CLI contract; scripts may depend on them.
EXIT_OK = 0
EXIT_FAILURE = 1  # a stage failed (parity, server, external tool returned non-zero)
EXIT_USAGE = 2  # bad input: arguments, model directory, names
EXIT_TOOL_MISSING = 3  # an external toolchain (trtllm-build, trtexec, tritonserver) is absent
EXIT_INVALID = 4  # `forge validate` found problems
EXIT_PLUGIN = 5  # a plugin failed to load or implements an unknown hook
EXIT_INTERRUPTED = 130


class ForgeError(Exception):
    """An error reported to the user as one line, with a stable exit code."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def one_line(self) -> str:
        text = str(self).rstrip(".")
        if not self.hint:
            return text
        return f"{text}. {self.hint[:1].upper()}{self.hint[1:]}"


class UsageError(ForgeError):
    """Bad input: arguments, paths, checkpoints the user pointed forge at."""

    exit_code = EXIT_USAGE


class ToolMissingError(ForgeError):
    """An external tool that the chosen target needs is not installed."""

    exit_code = EXIT_TOOL_MISSING


class ValidationError(ForgeError):
    """A model repository or ensemble graph is inconsistent."""

    exit_code = EXIT_INVALID


class PluginError(ForgeError):
    """A plugin could not be loaded or registered."""

    exit_code = EXIT_PLUGIN
