"""The wire layer: message codec, broker transports and the weight store (CONTRIBUTING.md)."""
