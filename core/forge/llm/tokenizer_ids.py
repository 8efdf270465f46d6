"""A decoder's end, pad and end-of-turn token ids, read once at build time from its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import UsageError


def tokenizer_defaults(source: Path, spec) -> dict[str, Any]:
    """End/pad ids and extra end-of-turn ids, read once at build time (and proving the tokenizer loads)."""
    from ..in_triton import forge_text

    try:
        tokenizer = forge_text.load_tokenizer(str(source), trust_remote_code=spec.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any loader failure means the same thing to the user
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise UsageError(f"cannot load the tokenizer in {source}: {type(exc).__name__}: {reason}",
                         hint="check the tokenizer files (or pass --trust-remote-code if it needs custom code)")
    eos: list[int] = []
    generation = source / "generation_config.json"
    if generation.is_file():
        try:
            value = json.loads(generation.read_text()).get("eos_token_id")
        except ValueError:
            value = None
        eos = [int(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.insert(0, int(tokenizer.eos_token_id))
    if not eos:
        raise UsageError(f"the tokenizer in {source} has no end-of-sequence token",
                         hint="set one with -o end_id=<token id>")
    pad = tokenizer.pad_token_id
    return {"end_id": eos[0], "pad_id": eos[0] if pad is None else int(pad),
            "stop_token_ids": ",".join(str(t) for t in eos[1:]), "vocab": len(tokenizer)}
