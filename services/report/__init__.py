"""Run reports: metric records, the run directory (JSON/CSV/PNG) and the summary table."""
