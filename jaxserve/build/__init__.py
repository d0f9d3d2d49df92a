"""The build layer: turns an EngineConfig into an engine's parts before the loop runs
(layout, weights, model drafter, cache plan, KV budget, runner). EngineCore builds
through it, and the planner (`python -m jaxserve.plan`) is an entry point over it."""
