"""Data-plane backends of the transfer agent, imported lazily by name."""
