"""What a job asks of its data: the `[data]` settings the loaders need, as plain values.

The data layer knows no configuration classes; `services.common.jobdata` builds this from
the job's `[data]` section (docs/data.md lists every key).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataRequest:
    dataset: str
    """A built-in name, a generic kind (`GENERIC_KINDS`) or a plugin's name."""
    dir: str = ""
    """The data directory: built-in datasets' files, and the base of a relative `path`."""
    path: str = ""
    """The generic kinds' file (npz) or folder (image_folder)."""
    test_path: str = ""
    """npz only: a second file holding the test split."""
    image_size: int = 0
    """image_folder only: resize every image to this square side (0: keep the sizes)."""
    test_fraction: float = 0.2
    """The share held out as the test split when the data comes without one."""
    seed: int = 0
    """Seeds that hold-out."""
    normalize: bool = True
    mean: tuple[float, ...] = ()
    """Overrides of the dataset's per-channel normalisation constants; (): its own."""
    std: tuple[float, ...] = ()

    def resolve(self, path: str) -> Path:
        """A `path`/`test_path` value as a path: relative ones are relative to `dir` when it
        is set, else to the working directory."""
        given = Path(path).expanduser()
        return given if given.is_absolute() or not self.dir else Path(self.dir) / given
