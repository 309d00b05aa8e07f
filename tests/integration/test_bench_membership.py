"""benchmarks/membership_ops.py in its quick mode over a private Redis: it runs, and what it
counts shows the coordinator's store work per event not growing with the members."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.membership_ops import main
from tests.integration.sentinel_cluster import require_redis_server

pytestmark = pytest.mark.redis


def test_the_quick_benchmark_counts_the_same_redis_work_at_each_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_redis_server()
    out = tmp_path / "membership.json"
    main(["--quick", "--json", str(out)])
    results = json.loads(out.read_text())
    assert [r["members"] for r in results] == [100, 1000]
    small, large = results
    for event in ("join", "heartbeat"):
        # Redis's own count of commands, those inside scripts too: a read of every member per
        # event would grow tenfold here.
        # (A health-check PING of redis-py's pool may fall inside one measurement.)
        assert abs(small[event]["commands"] - large[event]["commands"]) < 0.05, event
        expected = {"join": 2, "heartbeat": 1}[event]
        assert abs(small[event]["scripts"] - expected) < 0.05, event
        assert abs(large[event]["scripts"] - expected) < 0.05, event
    # One script per HostHeartbeat (of up to 1,024 members): per member, about its own renewal.
    assert large["host_member"]["commands"] < 2.1 and large["host_member"]["scripts"] < 0.01
    # The sweep asks about the expired members only, and announces each.
    for result in results:
        sweep = result["sweep"]
        assert sweep["announced"] == sweep["expired"] >= result["members"] // 100
    assert large["sweep"]["sweep_commands"] < large["sweep"]["sync_commands"] / 20
    assert "## Membership cost per event (issue 13)" in capsys.readouterr().out
