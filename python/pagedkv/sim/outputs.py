"""Check `--json` and `--plot` before the run, so that a typo costs seconds, not the run.

What can be known in advance is checked: the folder exists (and is a folder), the plot's
file type is one matplotlib writes, matplotlib is installed. The write itself can still fail
(a full disk, no permission), and then the error names the file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# File types matplotlib's Agg backend saves with nothing else installed (a subset of
# `FigureCanvasBase.get_supported_filetypes()`), listed so that the check imports nothing.
PLOT_TYPES = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def _folder(flag: str, path: str) -> None:
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"{flag} {path}: the folder {folder} {what}")
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file name")


def check_outputs(json_path: str | None, plot_path: str | None) -> None:
    """Raise ValueError (or RuntimeError: matplotlib missing) for an output that would fail."""
    if json_path is not None:
        _folder("--json", json_path)
    if plot_path is None:
        return
    _folder("--plot", plot_path)
    suffix = Path(plot_path).suffix.lower().lstrip(".")
    if suffix not in PLOT_TYPES:
        raise ValueError(
            f"--plot {plot_path}: the file name must end in one of "
            f"{', '.join('.' + t for t in PLOT_TYPES)} (it picks the image format)"
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(
            "--plot needs matplotlib: pip install matplotlib (from a checkout: pip install "
            "'.[plot]')"
        )


__all__ = ["PLOT_TYPES", "check_outputs"]
