"""Pallas kernels for jaxserve, each with a pure-jnp reference beside it."""
