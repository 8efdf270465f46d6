"""forge: Hugging Face checkpoints to complete NVIDIA Triton model repositories."""

import pluggy

__version__ = "0.1.0"

#: Marker for plugin hook implementations: ``@forge.hookimpl def forge_export(...)``.
hookimpl = pluggy.HookimplMarker("forge")

__all__ = ["__version__", "hookimpl"]
