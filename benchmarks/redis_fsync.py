"""What `appendfsync always` costs the weight store against `everysec`; run by hand.

    python -m benchmarks.redis_fsync [--dir DIR] [--models cnn5:block1,resnet18:layer1]
                                     [--versions 10] [--checkpoints 30] [--small 300]
                                     [--write-docs]

For each policy it starts a private `redis-server --appendonly yes --appendfsync POLICY` with
its AOF in a fresh directory under `--dir` (default: a temporary directory; give one on the
disk production would use, never tmpfs, where fsync costs nothing), and times, one call after
another from one client, the store operations the roles make:

- `publish_version`: a version of each model as SFL publishes it (client, aux and server
  parts: cnn5 at block1 about 95 KiB, resnet18 at layer1 about 45 MB), what the aggregator
  does once per round;
- `save_checkpoint`: the server part with a worker's bookkeeping, what a worker does every
  `workers.checkpoint_every_steps` steps before acking the batches it covers;
- `heartbeat` and `acquire_lease` (renewal): the small writes every role makes every second
  or so.

`--write-docs` rewrites the "redis-fsync" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

from benchmarks.common import Summary, command_line, machine_line, summarise, write_section
from broker.redis_store import RedisWeightStore
from broker.store import SERVER_PART, Checkpoint
from models.registry import build_model
from services.algorithms.registry import build_strategy

SECTION = "redis-fsync"
POLICIES = ("everysec", "always")
Results = dict[str, dict[str, Summary]]  # policy -> operation -> timings
JOB = "bench-fsync"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(policy: str, directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", policy, "--dir", str(directory)]
    log = (directory / "redis.log").open("ab")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    for _ in range(200):
        try:
            if client.ping():
                return process, port
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server ({policy}) did not start; see {directory}/redis.log")


def measure(model_name: str, cut: str, base: Path, args: argparse.Namespace) -> Results:
    """Both policies side by side, their calls interleaved (one on each server in turn), so
    that the load of a shared machine weighs on both alike."""
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10)
    blobs = build_strategy("sfl").initial_weights(model, cut)
    server = next(w for ref, w in blobs.items() if ref.part == SERVER_PART)
    generator = torch.Generator().manual_seed(1)
    # Fresh weights for each version (blobs are content-addressed: identical ones are shared),
    # made before the clock starts.
    versions = [
        {
            ref: {n: t + torch.randn(t.shape, generator=generator) for n, t in w.items()}
            for ref, w in blobs.items()
        }
        for _ in range(args.versions)
    ]
    checkpoints = [
        Checkpoint(0, i, {n: t + i for n, t in server.items()}, {"seqs": {"c": i}, "steps": i})
        for i in range(args.checkpoints)
    ]
    servers: dict[str, tuple[subprocess.Popen[bytes], RedisWeightStore]] = {}
    try:
        for policy in POLICIES:
            directory = base / f"{model_name}-{policy}"
            directory.mkdir()
            process, port = start_redis(policy, directory)
            servers[policy] = (process, RedisWeightStore(f"redis://127.0.0.1:{port}/0"))
        stores = {policy: store for policy, (_, store) in servers.items()}
        current = dict.fromkeys(POLICIES, 0)

        def publish(policy: str, i: int) -> None:
            current[policy] = stores[policy].publish_version(JOB, current[policy], versions[i])

        ops: dict[str, tuple[int, Callable[[str, int], object]]] = {
            "publish_version": (args.versions, publish),
            "save_checkpoint": (
                args.checkpoints,
                lambda p, i: stores[p].save_checkpoint(JOB, checkpoints[i]),
            ),
            "heartbeat": (args.small, lambda p, i: stores[p].heartbeat(JOB, "w1", 5.0)),
            "acquire_lease": (
                args.small,
                lambda p, i: stores[p].acquire_lease(JOB, "shard-0", "w1", 5.0),
            ),
        }
        samples: dict[str, dict[str, list[float]]] = {p: {} for p in POLICIES}
        for name, (count, op) in ops.items():
            for i in range(count):
                for policy in POLICIES:
                    start = time.perf_counter()
                    op(policy, i)
                    samples[policy].setdefault(name, []).append(time.perf_counter() - start)
    finally:
        for process, store in servers.values():
            store.close()
            process.kill()
            process.wait(10)
    return {p: {op: summarise(xs) for op, xs in by_op.items()} for p, by_op in samples.items()}


def report(results: dict[str, Results], args: argparse.Namespace, load: str) -> str:
    lines = [
        "What `appendfsync always` costs the weight store against `everysec`: one client, one "
        "call after another, a private `redis-server --appendonly yes` per policy with its AOF "
        f"on {args.disk}, both running, their calls interleaved. Milliseconds per call as the "
        "role sees it (serialising and hashing the weights included), median / p90.",
        "",
        f"Command: `{command_line('benchmarks.redis_fsync')}`",
        "",
        f"Machine: {machine_line(load)}",
        "",
        "| model | operation | calls | everysec | always |",
        "|---|---|---|---|---|",
    ]
    for model, by_policy in results.items():
        for op, first in by_policy[POLICIES[0]].items():
            cells = [model, op, str(first.count)]
            for policy in POLICIES:
                s = by_policy[policy][op]
                cells.append(f"{s.median * 1e3:.2f} / {s.p90 * 1e3:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="Where the AOF directories go.")
    parser.add_argument("--models", default="cnn5:block1,resnet18:layer1", help="MODEL:CUT,...")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--checkpoints", type=int, default=30)
    parser.add_argument("--small", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="splitmq-fsync-", dir=args.dir))
    args.disk = describe_disk(base)
    load = f"load average {open('/proc/loadavg').read().split()[0]} at start"
    results: dict[str, Results] = {}
    try:
        for spec in args.models.split(","):
            model, cut = spec.split(":")
            results[f"{model} ({cut})"] = measure(model, cut, base, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = "## Redis AOF: appendfsync always vs everysec\n\n" + report(results, args, load)
    print(text)
    if args.write_docs:
        write_section(SECTION, text)


def describe_disk(path: Path) -> str:
    """The file system type under `path` (fsync on tmpfs is free: the numbers would lie)."""
    done = subprocess.run(
        ["df", "--output=fstype", str(path)], capture_output=True, text=True, check=False
    )
    kind = done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else "?"
    return f"{kind} ({path.parent})"


if __name__ == "__main__":
    main()
