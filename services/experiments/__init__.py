"""Reproducible experiments: `splitmq experiment NAME` runs a grid of jobs in this process and
writes its section of `docs/results.md`. How to add one: CONTRIBUTING.md, "Adding an experiment".
"""
