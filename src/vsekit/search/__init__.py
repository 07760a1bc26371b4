"""Search: index pictures with a trained model and find them by text (or captions by picture)."""
