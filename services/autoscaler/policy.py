"""The scaling rule: a pure function of what was observed, the limits, the time and its state.
The rules (first match wins) and why pressure and slack differ: docs/deployment.md,
"Autoscaling workers".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from services.config.root import AutoscalerSection


def capped(section: AutoscalerSection, shards: int) -> AutoscalerSection:
    """The configured limits, `max_workers` capped at the job's shard count S (and
    `min_workers` with it): a worker beyond S would hold no shard."""
    top = min(section.max_workers, shards)
    return section.model_copy(
        update={"min_workers": min(section.min_workers, top), "max_workers": top}
    )


@dataclass(frozen=True)
class Observation:
    depth: int  # ready messages over the job's shard queues
    busy: float | None  # mean busy fraction of the workers that report one
    running: int  # workers up and not asked to stop (including those still starting)
    starting: int = 0  # of those, not yet heartbeating in the store
    stopping: int = 0  # asked to stop, not exited yet


@dataclass(frozen=True)
class PolicyState:
    last_change_at: float | None = None
    slack_since: float | None = None


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str
    state: PolicyState


def decide(obs: Observation, limits: AutoscalerSection, state: PolicyState, now: float) -> Decision:
    running = obs.running
    slack = _slack(obs, limits)
    since = state.slack_since if state.slack_since is not None else now
    state = replace(state, slack_since=since if slack else None)

    def change(target: int, reason: str) -> Decision:
        return Decision(target, reason, PolicyState(last_change_at=now, slack_since=None))

    def hold(reason: str) -> Decision:
        return Decision(running, reason, state)

    if running < limits.min_workers:
        return change(limits.min_workers, f"below the minimum of {limits.min_workers}")
    if running > limits.max_workers:
        return change(limits.max_workers, f"above the maximum of {limits.max_workers}")
    if state.last_change_at is not None and now - state.last_change_at < limits.cooldown_s:
        return hold("cooling down")
    if obs.starting or obs.stopping:
        return hold(f"waiting for {obs.starting} to start, {obs.stopping} to stop")
    pressure = _pressure(obs, limits)
    if pressure:
        if running >= limits.max_workers:
            return hold(f"at the maximum of {limits.max_workers} ({pressure})")
        wanted = max(running + 1, math.ceil(obs.depth / limits.target_depth_per_worker))
        return change(min(limits.max_workers, wanted), pressure)
    if slack and state.slack_since is not None:
        if running <= limits.min_workers:
            return hold(f"at the minimum of {limits.min_workers}")
        if now - state.slack_since >= limits.scale_down_after_s:
            return change(running - 1, f"idle for {now - state.slack_since:.0f} s")
        return hold("idle, not for long enough")
    return hold("within the band")


def _pressure(obs: Observation, limits: AutoscalerSection) -> str:
    """Why more workers are needed ("" when they are not)."""
    if obs.depth > limits.target_depth_per_worker * obs.running:
        return f"{obs.depth} ready for {obs.running} workers"
    if obs.busy is not None and obs.busy >= limits.scale_up_busy:
        return f"workers {obs.busy:.0%} busy"
    return ""


def _slack(obs: Observation, limits: AutoscalerSection) -> bool:
    return obs.depth < limits.target_depth_per_worker and (
        obs.busy is None or obs.busy <= limits.scale_down_busy
    )
