"""The autoscaler: sizes a job's worker pool by shard queue depth and worker busy fraction."""
