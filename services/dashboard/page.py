"""The dashboard's HTTP routes: the page itself and its JSON state."""

from __future__ import annotations

import json
from importlib import resources

from services.dashboard.state import DashboardState
from services.metrics.endpoint import Route
from services.report.tables import finite

PAGE = "dashboard.html"


def page_html() -> bytes:
    return resources.files("services.dashboard").joinpath(PAGE).read_bytes()


def state_json(state: DashboardState) -> bytes:
    return json.dumps(finite(state.snapshot()), default=str, separators=(",", ":")).encode()


def dashboard_routes(state: DashboardState) -> dict[str, Route]:
    html = page_html()

    def index() -> tuple[str, bytes]:
        return "text/html; charset=utf-8", html

    def api_state() -> tuple[str, bytes]:
        return "application/json", state_json(state)

    return {"/": index, "/index.html": index, "/api/state": api_state}
