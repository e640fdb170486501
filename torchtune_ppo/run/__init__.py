"""Services around a run: optimizer, memory plan, metrics and watching, guards and signals."""
