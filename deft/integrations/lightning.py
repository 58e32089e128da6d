"""deft under lightning (being written)."""
