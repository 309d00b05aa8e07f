"""The aggregator: one core (inbox, gate, publication of version v+1) and two clocks (sync rounds,
async buffering), evaluation, metrics."""

from services.aggregator.aggregator import Aggregator, ensure_initial_version

__all__ = ["Aggregator", "ensure_initial_version"]
