"""Dtype-aware losses (placeholder file replaced by the losses work)."""
