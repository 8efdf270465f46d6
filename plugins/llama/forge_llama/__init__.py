"""forge llama family plugin (work in progress)."""
