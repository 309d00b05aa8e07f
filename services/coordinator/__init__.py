"""The coordinator: membership (Join / Leave / Heartbeat / expiry), shard assignment, Welcome."""

from services.coordinator.coordinator import Coordinator, CoordinatorStats

__all__ = ["Coordinator", "CoordinatorStats"]
