"""``python -m forge``."""

from .cli import run

run()
