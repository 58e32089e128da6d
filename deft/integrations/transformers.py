"""deft under transformers (being written)."""
