"""forge minilm family plugin (work in progress)."""
