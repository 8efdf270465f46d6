"""forge clip family plugin (work in progress)."""
