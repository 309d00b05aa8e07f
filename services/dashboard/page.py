"""The dashboard's HTTP routes: the page itself and its JSON state."""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

from services.dashboard.state import DashboardState
from services.metrics.endpoint import Route

PAGE = "dashboard.html"


def page_html() -> bytes:
    return resources.files("services.dashboard").joinpath(PAGE).read_bytes()


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def state_json(state: DashboardState) -> bytes:
    return json.dumps(finite(state.snapshot()), default=str, separators=(",", ":")).encode()


def dashboard_routes(state: DashboardState) -> dict[str, Route]:
    html = page_html()

    def index() -> tuple[str, bytes]:
        return "text/html; charset=utf-8", html

    def api_state() -> tuple[str, bytes]:
        return "application/json", state_json(state)

    return {"/": index, "/index.html": index, "/api/state": api_state}
