"""How long a `splitmq` command takes to start: the healthcheck's cost; run by hand.

    python -m benchmarks.cli_startup [--tree DIR] [--runs 5]

Runs `splitmq --help`, `splitmq check worker` and `splitmq check store` (against the Redis
at $SPLITMQ_REDIS_URL, default 127.0.0.1:6379: the check reads the job's members, finds no
worker and exits 1, the same work as a healthy check) and `python -c pass` for scale, each
`--runs` times in fresh processes, and prints the median wall time and CPU time (user + sys)
and whether torch got imported. `--tree DIR` measures another checkout of the sources, e.g.
an older commit exported with `git archive COMMIT | tar -x -C DIR`, with this interpreter.
CPU time is the steadier figure on a loaded machine; wall time is what a healthcheck waits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import machine_line

# Runs `splitmq ARGS` as the console script does, then says whether torch was imported.
ENTRY = (
    "import sys\n"
    "from services.cli.main import main\n"
    "sys.argv = ['splitmq', *sys.argv[1:]]\n"
    "try:\n    main()\n"
    "except SystemExit:\n    pass\n"
    "sys.stderr.write('TORCH=%s\\n' % ('torch' in sys.modules))\n"
)


def run_once(argv: Sequence[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """Wall seconds and the child's stderr."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _, err = proc.communicate()
    return time.perf_counter() - started, err


def measure(
    argv: Sequence[str], env: dict[str, str], cwd: Path, runs: int
) -> tuple[float, float, str]:
    """Median wall and CPU seconds of `runs` runs, and whether torch was imported."""
    walls, cpus, torch = [], [], "?"
    for _ in range(runs):
        # os.times() sums the reaped children's CPU: the difference is this one child's.
        before = os.times()
        wall, err = run_once(argv, env, cwd)
        after = os.times()
        walls.append(wall)
        cpus.append(
            (after.children_user - before.children_user)
            + (after.children_system - before.children_system)
        )
        for line in err.splitlines():
            if line.startswith("TORCH="):
                torch = "yes" if line.endswith("True") else "no"
    return statistics.median(walls), statistics.median(cpus), torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    tree = args.tree.resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env |= {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    redis_url = os.environ.get("SPLITMQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    folder = Path(tempfile.mkdtemp(prefix="cli-startup-"))
    try:
        config = folder / "job.toml"
        config.write_text(
            '[job]\nname = "cli-startup"\n[broker]\nkind = "rabbitmq"\n'
            f'[store]\nkind = "redis"\nredis_url = "{redis_url}"\n'
        )
        cases = {
            "splitmq --help": ["--help"],
            "splitmq check worker": ["--config", str(config), "check", "worker"],
            "splitmq check store": ["--config", str(config), "check", "store"],
        }
        print(f"tree {tree}; {args.runs} runs each; load {os.getloadavg()[0]:.1f}")
        print(machine_line())
        print(f"{'command':<24} {'wall median':>11} {'CPU median':>10}  torch")
        for name, cli_args in cases.items():
            wall, cpu, torch = measure(
                [sys.executable, "-c", ENTRY, *cli_args], env, tree, args.runs
            )
            print(f"{name:<24} {wall:>10.2f}s {cpu:>9.2f}s  {torch}")
        wall, cpu, _ = measure([sys.executable, "-c", "pass"], env, tree, args.runs)
        print(f"{'python -c pass':<24} {wall:>10.2f}s {cpu:>9.2f}s  no")
        print(f"load after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
