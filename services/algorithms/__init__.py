"""Split-learning algorithms: one strategy module each, over shared pure tensor functions."""
