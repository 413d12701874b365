"""Direct mode (placeholder while it is written)."""
