"""deft under accelerate (being written)."""
