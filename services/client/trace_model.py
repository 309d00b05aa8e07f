"""A generator of availability traces: diurnal availability with per-device sessions.

The model and where its defaults come from are in docs/traces.md ("The model"). In short: a
device in local hour h is online with target probability p(h), a cosine between a trough and a
peak at night (devices train while charging, idle and on Wi-Fi); it comes online at the rate
that makes p(h) its long-run fraction, and stays online for a lognormal session. Each device
has a time zone offset. Everything is drawn from one seed, each device from its own stream,
so device n's sessions do not depend on how many devices the trace has.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from services.client.traces import Interval, Trace

DAY_S = 86_400.0
_TZ_POINTS = 97  # quadrature points of the time-zone average in `expected_fraction`


@dataclass(frozen=True)
class DiurnalModel:
    """Parameters in the model's own time (a 24 h day); `generate` compresses to `day_s`."""

    peak_fraction: float = 0.40
    trough_fraction: float = 0.10
    peak_hour: float = 3.0  # local time of the peak
    session_median_s: float = 1_200.0
    session_sigma: float = 1.0  # of the session length's logarithm
    tz_spread_h: float = 0.0  # offsets uniform in [-spread/2, +spread/2] hours
    start_hour: float = 0.0  # the reference (offset 0) clock's hour at t = 0

    def __post_init__(self) -> None:
        if not 0 < self.trough_fraction <= self.peak_fraction < 1:
            raise ValueError(
                "need 0 < trough_fraction <= peak_fraction < 1, got "
                f"{self.trough_fraction} and {self.peak_fraction}"
            )
        if self.session_median_s <= 0 or self.session_sigma < 0 or self.tz_spread_h < 0:
            raise ValueError("session_median_s must be > 0, session_sigma and tz_spread_h >= 0")

    def fraction(self, t_s: float, offset_h: float = 0.0) -> float:
        """Target online probability at model time `t_s` of a device `offset_h` from the
        reference clock."""
        hour = self.start_hour + offset_h + t_s / 3_600.0
        swing = (1 + math.cos(2 * math.pi * (hour - self.peak_hour) / 24.0)) / 2
        return self.trough_fraction + (self.peak_fraction - self.trough_fraction) * swing

    def expected_fraction(self, t_s: float) -> float:
        """`fraction` averaged over the time-zone spread: the curve a large trace follows."""
        if self.tz_spread_h == 0:
            return self.fraction(t_s)
        offsets = (self.tz_spread_h * (k / (_TZ_POINTS - 1) - 0.5) for k in range(_TZ_POINTS))
        return sum(self.fraction(t_s, offset) for offset in offsets) / _TZ_POINTS

    def mean_session_s(self) -> float:
        return self.session_median_s * math.exp(self.session_sigma**2 / 2)

    def arrival_rate(self, t_s: float, offset_h: float) -> float:
        """Rate (1/s) at which an offline device comes online: an alternating process with
        mean session m online a fraction p of the time when this rate is p / (m (1 - p))."""
        p = self.fraction(t_s, offset_h)
        return p / (self.mean_session_s() * (1 - p))


def generate(
    model: DiurnalModel, clients: int, duration_s: float, *, day_s: float = DAY_S, seed: int = 0
) -> Trace:
    """A trace of `clients` devices (indices 0..clients-1) over [0, duration_s), one model day
    lasting `day_s` seconds (sessions shrink with it). Times are rounded to milliseconds."""
    if clients < 0 or not duration_s > 0 or not day_s > 0:
        raise ValueError("need clients >= 0, duration_s > 0 and day_s > 0")
    scale = day_s / DAY_S
    sessions: dict[int | str, tuple[Interval, ...]] = {}
    for index in range(clients):
        spans = _device(model, duration_s / scale, random.Random(f"splitmq-trace:{seed}:{index}"))
        rounded = ((round(a * scale, 3), round(b * scale, 3)) for a, b in spans)
        sessions[index] = tuple((a, b) for a, b in rounded if a < b)
    return Trace(sessions)


def _device(model: DiurnalModel, end_s: float, rng: random.Random) -> list[Interval]:
    offset = rng.uniform(-model.tz_spread_h / 2, model.tz_spread_h / 2)
    peak_rate = model.peak_fraction / (model.mean_session_s() * (1 - model.peak_fraction))
    log_median = math.log(model.session_median_s)
    spans: list[Interval] = []
    t = 0.0
    online = rng.random() < model.fraction(0.0, offset)
    while t < end_s:
        if online:
            length = rng.lognormvariate(log_median, model.session_sigma)
            spans.append((t, min(t + length, end_s)))
            t += length
        else:
            # Thinning of a Poisson process at the peak rate: the arrival rate follows the
            # hour, so a device offline through the trough still comes back when p rises.
            t += rng.expovariate(peak_rate)
            while t < end_s and rng.random() * peak_rate > model.arrival_rate(t, offset):
                t += rng.expovariate(peak_rate)
        online = not online
    return spans
