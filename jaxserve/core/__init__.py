"""Host-only engine core: requests, the paged KV page pool and the scheduler.

Nothing in this package may import jax, directly or transitively; it is plain
Python + numpy so that scheduling never touches the accelerator runtime.
"""
