"""The benchmarks' one harness: every benchmark is a command with the same options and guard, one environment record,
results written the same way, and one timer that alternates the runs it compares.

    bench = Bench("host", __doc__)                      # python -m benchmarks.host and its output options
    bench.parser.add_argument("--rounds", ...)          # the benchmark's own options
    args = bench.parse(argv)                            # the guard: --quick never writes the committed results
    env = bench.environment(device, rounds=args.rounds) # device name, torch, threads, date, and its own fields
    times = alternate({"plain": plain.turn, "L1": l1.turn}, rounds=7)
    folder = bench.folder(args, device)                 # benchmarks/runs/<device>/, or where the options say
    bench.write(folder, env, rows, table)               # host.json, host.md, host.csv
    print(where(folder))                                # the run's last line: where its results are

Where results go, one rule for every benchmark:

- by default ``benchmarks/runs/<device>/`` (git-ignored), a smoke test's (``--quick``) in its ``quick/``;
- ``--update-results``: the committed results, ``benchmarks/results/<device>/``, for a run meant to refresh them;
- ``--out DIR``: DIR (with ``--update-results``: refused, the two name different folders).

``--quick`` runs a smoke test's sizes and is refused with ``--update-results`` (and with an ``--out`` inside
``benchmarks/results/``): a smoke test's figures never reach the committed results. A benchmark that merges with
earlier results reads them from the folder it writes. Files: ``<name>.json`` (the environment and the rows, and any
other parts a benchmark keeps), ``<name>.md`` (its table) and ``<name>.csv`` (the rows, one line each).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.device import device_name, device_slug

__all__ = [
    "Bench", "add_output_options", "alternate", "check_output", "kept_rows", "now", "read_results", "results_folder",
    "summary", "where", "write_csv",
]  # fmt: skip

RESULTS = Path(__file__).resolve().parent / "results"  # committed: written only with --update-results
RUNS = Path(__file__).resolve().parent / "runs"  # git-ignored: every other run's results
SMOKE_GUARD = (
    "{flag} writes a smoke test's figures: to --out DIR, or else benchmarks/runs/<device>/quick/; never to the "
    "committed results (--update-results, or an --out inside benchmarks/results/)"
)
QUICK_GUARD = SMOKE_GUARD.format(flag="--quick")
OUT_GUARD = (
    "--out DIR and --update-results name different folders: give one (--out writes DIR, --update-results the "
    "committed benchmarks/results/<device>/)"
)


def summary(doc: str) -> str:
    """A module docstring's first paragraph on one line: a command's ``--help`` description, whole."""
    return " ".join((doc or "").split("\n\n")[0].split())


def now() -> str:
    """The date and time results are stamped with: universal time, to the minute, as the stamp itself says."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class Bench:
    """One benchmark's command: ``python -m benchmarks.<name>``, its parser with ``--out``, ``--update-results`` and
    ``--quick`` (``quick``: what a smoke test runs; ``None``: no quick mode), its environment record and its results."""

    def __init__(self, name: str, doc: str | None, quick: str | None = "tiny sizes", **parser_options) -> None:
        self.name = name
        parser_options.setdefault("prog", f"python -m benchmarks.{name}")
        parser_options.setdefault("description", summary(doc or ""))
        self.parser = argparse.ArgumentParser(**parser_options)
        add_output_options(self.parser)
        self.quick = quick is not None
        if self.quick:
            what = f"{quick}: a smoke test (to --out, or benchmarks/runs/<device>/quick/)"
            self.parser.add_argument("--quick", action="store_true", help=what)

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """The command line, with the guard: a smoke test never writes the committed results."""
        args = self.parser.parse_args(argv)
        check_output(self.parser, args, "--quick" if self.quick and args.quick else None)
        return args

    def folder(self, args: argparse.Namespace, device: str) -> Path:
        """Where this run writes (:func:`results_folder`) for the command line ``args``."""
        return results_folder(args.out, device, update=args.update_results, smoke=self.quick and args.quick)

    def environment(self, device: str, **fields) -> dict:
        """What every result records: the device (its name and folder), torch's version and threads, the date, and
        the benchmark's own ``fields``."""
        return {"device": device_slug(device), "device_name": device_name(device), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "date": now(), **fields}  # fmt: skip

    def write(self, folder: Path, env: dict, rows: list[dict], table: str, indent: int = 2, **parts) -> Path:
        """``<name>.json`` (``{"environment": env, "rows": rows, **parts}``), ``<name>.md`` (``table``) and
        ``<name>.csv`` (``rows``) in ``folder``; returns the markdown's path."""
        folder.mkdir(parents=True, exist_ok=True)
        result = {"environment": env, "rows": rows, **parts}
        (folder / f"{self.name}.json").write_text(json.dumps(result, indent=indent, default=str) + "\n")
        write_csv(folder / f"{self.name}.csv", rows)
        path = folder / f"{self.name}.md"
        path.write_text(table)
        return path


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV, one line each, the columns every row's keys in order of first appearance (a nested value as
    its JSON)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list, tuple)) else v for k, v in row.items()})


def alternate(turns: dict[str, Callable[[], float | list[float]]], rounds: int) -> dict[str, list[float]]:
    """The alternating timer: ``rounds`` rounds of every run's turn in order (a turn gives one time or several), so
    that whatever else the machine does falls on each run alike; each run's times, for its median."""
    times: dict[str, list[float]] = {name: [] for name in turns}
    for _ in range(rounds):
        for name, turn in turns.items():
            got = turn()
            times[name] += got if isinstance(got, list) else [got]
    return times


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` and ``--update-results``: where a run writes (:func:`results_folder`)."""
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="results folder; default benchmarks/runs/<device>/ (git-ignored)"
    )
    parser.add_argument(
        "--update-results", action="store_true",
        help="write the committed results, benchmarks/results/<device>/ (a run meant to refresh them)",
    )  # fmt: skip


def check_output(parser: argparse.ArgumentParser, args: argparse.Namespace, smoke: str | None = None) -> None:
    """Refuse ``--out`` with ``--update-results``, and a smoke test (``smoke``: its flag, "--quick", given) that would
    write the committed results."""
    if args.out is not None and args.update_results:
        parser.error(OUT_GUARD)
    if smoke and (args.update_results or (args.out is not None and _inside(args.out, RESULTS))):
        parser.error(SMOKE_GUARD.format(flag=smoke))


def results_folder(out: Path | None, device: str, update: bool = False, smoke: bool = False) -> Path:
    """Where a run writes: ``out``; else with ``update`` the committed ``benchmarks/results/<device>/``; else the
    git-ignored ``benchmarks/runs/<device>/`` (a smoke test's: its ``quick/``). ``device``: "cpu", "cuda" (its GPU's
    model) or a folder's name ("h100"). Not made here: :meth:`Bench.write` makes it."""
    if out is not None:
        return out
    slug = device_slug(device) if device in ("cpu", "cuda") else device
    if update:
        return RESULTS / slug
    return RUNS / slug / "quick" if smoke else RUNS / slug


def where(folder: Path) -> str:
    """The line a run ends with: the folder its results are in, and whether they are the committed ones."""
    shown = _shown(folder)
    if _inside(folder, RESULTS):
        return f"results written to {shown}: the committed results (git diff shows what changed)"
    if _inside(folder, RUNS):
        return f"results written to {shown} (git-ignored; --update-results writes the committed benchmarks/results/)"
    return f"results written to {shown}"


def _inside(folder: Path, root: Path) -> bool:
    return folder.resolve().is_relative_to(root.resolve())


def _shown(folder: Path) -> str:
    """``folder`` relative to the working directory where it is below it, else absolute."""
    path = folder.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def read_results(folder: Path, name: str) -> dict | None:
    """What :meth:`Bench.write` wrote as ``<name>.json`` in ``folder``, or ``None`` if nothing is there."""
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def kept_rows(old: dict, part: str, dates: str, group, ran: set) -> tuple[list[dict], dict[str, str]]:
    """The rows of ``old[part]`` (a results file's contents) whose ``group(row)`` is not in ``ran``, and each kept
    group's run date: the one ``old["environment"][dates]`` gives it (kept itself from an earlier run), else the old
    run's. For a benchmark that reruns some of its models or sections and keeps the others."""
    kept = [r for r in old[part] if group(r) not in ran]
    earlier, date = old["environment"].get(dates, {}), old["environment"]["date"]
    return kept, {g: earlier.get(g, date) for g in dict.fromkeys(map(group, kept))}
