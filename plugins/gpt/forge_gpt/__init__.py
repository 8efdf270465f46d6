"""forge gpt family plugin (work in progress)."""
