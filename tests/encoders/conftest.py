"""Fixtures of the encoder tests (shared with tests/minilm, tests/clip and tests/encoders)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "encoders"))

from encoder_fixtures import *  # noqa: E402,F401,F403
