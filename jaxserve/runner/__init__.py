"""Device side of the engine: batches, the jitted step, sampling."""
