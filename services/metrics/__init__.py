"""Metrics: what roles report about themselves (`Metrics`), and its Prometheus exposition.

Role code only ever sees the small `Metrics` protocol of `recorder`; `prometheus` and `endpoint`
are imported by the process edge (the CLI, the embedded runner) when metrics are on.
"""
