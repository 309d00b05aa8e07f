"""`scripts/cluster.sh down` stops a RabbitMQ node that has no pid file: one still booting, or
one an interrupted run left behind after its directory was deleted. Such a node holds its
ports, and the next `up` failed on it (a node "did not start")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep (procps)")
def test_down_stops_a_node_left_without_its_directory(tmp_path: Path) -> None:
    cluster_dir = tmp_path / "cluster"  # never created: the run that made it deleted it
    # A stand-in for the orphaned Erlang VM: its command line as RabbitMQ's would read.
    orphan = subprocess.Popen(
        [
            "bash",
            "-c",
            'exec -a beam.smp "$0" -c "import time; time.sleep(120)" -home "$1" --',
            sys.executable,
            str(cluster_dir / "rabbit-2"),
        ],
        start_new_session=True,
    )
    try:
        env = os.environ | {"SPLITMQ_CLUSTER_DIR": str(cluster_dir)}
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "cluster.sh"), "down"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 10
        while orphan.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan.returncode == -9, "the orphaned node is still running"
    finally:
        orphan.kill()
        orphan.wait()
