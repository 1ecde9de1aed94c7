"""State flows, one package per kind (docs/semantics.md §6)."""
