"""Where a benchmark writes its results, and how: ``<name>.json`` (environment and rows) and ``<name>.md`` (its
table) under ``benchmarks/results/<device>/`` unless ``--out`` names a folder."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.device import device_slug

__all__ = ["kept_rows", "read_results", "results_folder", "write_results"]

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


def read_results(folder: Path, name: str) -> dict | None:
    """What :func:`write_results` wrote as ``<name>.json`` in ``folder``, or ``None`` if nothing is there."""
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def kept_rows(old: dict, part: str, dates: str, group, ran: set) -> tuple[list[dict], dict[str, str]]:
    """The rows of ``old[part]`` (a results file's contents) whose ``group(row)`` is not in ``ran``, and each kept
    group's run date: the one ``old["environment"][dates]`` gives it (kept itself from an earlier run), else the old
    run's. For a benchmark that reruns some of its models or sections and keeps the others."""
    kept = [r for r in old[part] if group(r) not in ran]
    earlier, date = old["environment"].get(dates, {}), old["environment"]["date"]
    return kept, {g: earlier.get(g, date) for g in dict.fromkeys(map(group, kept))}
