"""OpenAI-compatible HTTP server: `python -m jaxserve.api`."""
