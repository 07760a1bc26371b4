"""Self-contained experiments that need no dataset (`vse experiment …`)."""
