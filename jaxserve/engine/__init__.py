"""The engine loop and its front doors (offline LLM, async engine)."""
