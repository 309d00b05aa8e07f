"""The coordinator: membership (Join / Leave / Heartbeat / expiry), shard assignment, Welcome."""
