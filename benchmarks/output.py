"""Where a benchmark writes its results, and how: ``<name>.json`` (environment and rows) and ``<name>.md`` (its
table) under ``benchmarks/results/<device>/`` unless ``--out`` names a folder."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.device import device_slug

__all__ = ["results_folder", "write_results"]

RESULTS = Path(__file__).resolve().parent / "results"


def results_folder(out: Path | None, device: str) -> Path:
    """``out``, or the committed results' folder of ``device`` ("cpu", "h100", ...); made if missing."""
    folder = out or RESULTS / device_slug(device)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(folder: Path, name: str, env: dict, rows: list[dict], table: str, indent: int = 2) -> None:
    """``<name>.json`` with ``{"environment": env, "rows": rows}`` and ``<name>.md`` with ``table``."""
    (folder / f"{name}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=indent) + "\n")
    (folder / f"{name}.md").write_text(table)
