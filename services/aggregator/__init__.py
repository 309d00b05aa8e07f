"""The aggregator: one core (inbox, gate, publication of version v+1) and two clocks (sync rounds,
async buffering), evaluation, metrics."""
