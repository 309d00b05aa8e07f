"""The worker pool: processes that hold shard replicas of the server-side model."""
