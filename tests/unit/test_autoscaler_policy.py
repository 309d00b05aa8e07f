"""The scaling rule (services/autoscaler/policy.py), driven by a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from services.autoscaler.policy import Decision, Observation, PolicyState, capped, decide
from services.config.root import AutoscalerSection

LIMITS = AutoscalerSection(
    min_workers=1,
    max_workers=4,
    target_depth_per_worker=10,
    scale_up_busy=0.8,
    scale_down_busy=0.2,
    cooldown_s=30.0,
    scale_down_after_s=60.0,
)


@dataclass
class Scaler:
    """The policy with its state threaded through, and a clock the test moves."""

    limits: AutoscalerSection = LIMITS
    now: float = 1000.0
    state: PolicyState = field(default_factory=PolicyState)

    def see(self, running: int, *, depth: int = 0, busy: float | None = 0.5, **kw: int) -> Decision:
        decision = decide(
            Observation(depth, busy, running, **kw), self.limits, self.state, self.now
        )
        self.state = decision.state
        return decision

    def wait(self, seconds: float) -> None:
        self.now += seconds


def test_below_the_minimum_starts_workers_at_once_even_while_cooling_down() -> None:
    s = Scaler()
    assert s.see(0).target == 1
    assert s.see(0).target == 1  # still none up (it died): the minimum holds regardless
    s2 = Scaler(limits=LIMITS.model_copy(update={"min_workers": 3}))
    assert s2.see(1, busy=0.0).target == 3


def test_above_the_maximum_is_cut_back() -> None:
    assert Scaler().see(6).target == 4


def test_busy_workers_add_one_at_a_time_with_a_cooldown_between() -> None:
    s = Scaler()
    first = s.see(1, busy=0.9)
    assert (first.target, first.reason) == (2, "workers 90% busy")
    s.wait(29)
    held = s.see(2, busy=0.95)
    assert (held.target, held.reason) == (2, "cooling down")
    s.wait(2)
    assert s.see(2, busy=0.95).target == 3


def test_a_backlog_grows_the_pool_to_cover_it_up_to_the_maximum() -> None:
    s = Scaler()
    assert s.see(1, depth=35, busy=0.1).target == 4  # ceil(35 / 10)
    s.wait(31)
    decision = s.see(4, depth=500, busy=1.0)
    assert decision.target == 4 and decision.reason.startswith("at the maximum")


def test_a_backlog_at_or_below_the_target_depth_is_no_pressure() -> None:
    s = Scaler()
    assert s.see(2, depth=20, busy=0.5).target == 2
    assert s.see(2, depth=21, busy=0.5).target == 3


def test_nothing_is_decided_while_workers_start_or_stop() -> None:
    s = Scaler()
    assert s.see(2, busy=1.0, starting=1).target == 2
    assert s.see(2, busy=1.0, stopping=1).target == 2
    assert s.see(2, busy=1.0).target == 3


def test_idle_workers_go_one_at_a_time_once_idle_long_enough() -> None:
    s = Scaler()
    assert s.see(3, busy=0.1).reason == "idle, not for long enough"
    s.wait(59)
    assert s.see(3, busy=0.05).target == 3
    s.wait(1)
    assert s.see(3, busy=0.0).target == 2
    # The idle clock restarts after a change, and the cool-down applies too.
    s.wait(30)
    assert s.see(2, busy=0.0).target == 2
    s.wait(60)
    assert s.see(2, busy=0.0).target == 1
    s.wait(1000)
    assert s.see(1, busy=0.0).reason == "at the minimum of 1"


def test_load_inside_the_band_resets_the_idle_clock() -> None:
    s = Scaler()
    s.see(3, busy=0.1)
    s.wait(50)
    assert s.see(3, busy=0.5).reason == "within the band"  # hysteresis: neither up nor down
    s.wait(50)
    assert s.see(3, busy=0.1).target == 3  # idle again, but only just
    s.wait(60)
    assert s.see(3, busy=0.1).target == 2


def test_a_queue_that_is_not_empty_is_not_idle() -> None:
    s = Scaler()
    s.see(2, depth=12, busy=0.0)
    s.wait(1000)
    assert s.see(2, depth=12, busy=0.0).target == 2
    s.see(2, depth=9, busy=0.0)
    s.wait(60)
    assert s.see(2, depth=9, busy=0.0).target == 1


def test_no_busy_report_with_an_empty_queue_counts_as_idle_and_a_backlog_starts_one() -> None:
    limits = LIMITS.model_copy(update={"min_workers": 0, "scale_down_after_s": 0.0})
    s = Scaler(limits=limits)
    assert s.see(1, busy=None).target == 0
    s.wait(31)
    assert s.see(0, busy=None).reason == "at the minimum of 0"
    assert s.see(0, depth=1, busy=None).target == 1


def test_limits_cap_the_maximum_at_the_shard_count() -> None:
    section = AutoscalerSection(min_workers=2, max_workers=8)
    assert capped(section, shards=3).max_workers == 3
    assert capped(section, shards=1) == capped(
        AutoscalerSection(min_workers=1, max_workers=1), shards=1
    )


def test_settings_refuse_inverted_bounds_and_thresholds() -> None:
    with pytest.raises(ValidationError, match="min_workers"):
        AutoscalerSection(min_workers=5, max_workers=2)
    with pytest.raises(ValidationError, match="hysteresis"):
        AutoscalerSection(scale_up_busy=0.5, scale_down_busy=0.5)
