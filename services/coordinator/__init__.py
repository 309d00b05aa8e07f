"""The coordinator: membership (Join / Leave / Heartbeat / expiry), shard assignment, Welcome."""

from services.coordinator.coordinator import Coordinator

__all__ = ["Coordinator"]
