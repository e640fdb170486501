"""Services around a run: the preflight (every check against the world before any weights
load), optimizer, memory plan, metrics and watching, guards and signals."""
