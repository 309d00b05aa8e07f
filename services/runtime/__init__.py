"""Wiring: broker/store factories, the embedded runner and local-process launcher."""
