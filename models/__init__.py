"""Functional Flax model definitions served by jaxserve."""
