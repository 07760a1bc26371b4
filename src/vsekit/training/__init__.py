"""Training loop and checkpoints."""
