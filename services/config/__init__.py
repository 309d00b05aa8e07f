"""Typed settings, loaded from a TOML file and overridden from the environment."""
