"""Interoperability with other code: importers for the released research checkpoints."""
