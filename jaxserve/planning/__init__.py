"""Planning: what a model needs on a mesh (memory, the cache plan, the TPU compile),
computed from its config without allocating anything."""
