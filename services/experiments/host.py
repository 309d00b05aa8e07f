"""The machine a run ran on, and how busy it was (experiments share hosts with other work)."""

from __future__ import annotations

import math
import os
import platform

import torch


def machine_line() -> str:
    """OS, CPU, cores, Python, torch and its intra-op threads."""
    return ", ".join(
        [
            platform.platform(),
            platform.processor() or platform.machine(),
            f"{os.cpu_count()} CPUs",
            f"python {platform.python_version()}",
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)",
        ]
    )


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan
