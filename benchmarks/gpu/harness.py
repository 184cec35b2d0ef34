"""Arms in child processes, each under its own time limit, and results written as each row arrives.

An arm runs as ``python -m benchmarks.gpu --child ARM``: a process of its own, so that it starts with an empty
CUDA allocator (peaks and maximum batches of one arm do not inherit another's cache or fragments) and can be
stopped at its limit whatever it is doing (a compilation, a kernel). The child prints each result as a line
``MARKER + json``; the parent merges it into the results by its ``id`` and writes the files at once, so a run
cut short, by an arm's limit or by the whole command's, keeps everything measured before the cut. Anything
else the child prints is passed through.

The child also keeps a :class:`Deadline` and starts no measurement that cannot finish before it: the parent's
kill is the backstop, not the plan.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MARKER", "ArmRun", "Deadline", "child_command", "emit", "run_arm"]

MARKER = "gactx-gpu-row "
GRACE_S = 5  # after its limit, an arm gets this long to end on its own before it is killed
ROOT = Path(__file__).resolve().parents[2]


class Deadline:
    """Seconds left before a moment, for the child's own checks."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether something expected to take ``seconds`` can finish in time."""
        return self.left() > seconds


def emit(row: dict) -> None:
    """Send one result (or part of one: rows with the same ``id`` are merged) to the parent."""
    print(MARKER + json.dumps(row, default=str), flush=True)


@dataclass
class ArmRun:
    """How an arm ended: ``status`` is "done", "cut at its limit", "failed (exit N)" or "not started"."""

    name: str
    limit_s: float
    status: str = "not started"
    seconds: float = 0.0
    rows: int = 0
    errors: list[str] = field(default_factory=list)


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def child_command(name: str, limit_s: float, *args: str) -> list[str]:
    """The command that runs the arm ``name`` in a child process."""
    return [sys.executable, "-m", "benchmarks.gpu", "--child", name, "--limit-s", f"{limit_s:.0f}", *args]


def run_arm(name: str, limit_s: float, command: list[str], on_row: Callable[[dict], None]) -> ArmRun:
    """Run ``command`` (:func:`child_command`) for at most ``limit_s`` seconds (plus a grace), handing each row
    it emits to ``on_row`` as it arrives."""
    run = ArmRun(name, limit_s)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    # A session of its own: at the limit the whole group goes, Inductor's compile workers with it (they hold
    # the pipe open otherwise).
    child = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
    cut = False
    try:
        while True:
            left = limit_s + GRACE_S - (time.monotonic() - start)
            try:  # after the cut, what the child wrote before it is still read
                line = lines.get(timeout=1.0 if cut else max(0.0, left))
            except queue.Empty:
                if cut:
                    break
                cut = True
                os.killpg(child.pid, signal.SIGKILL)
                continue
            if line is None:
                break
            if line.startswith(MARKER):
                row = json.loads(line[len(MARKER) :])
                if row.get("kind") == "error":
                    run.errors.append(row["error"])
                run.rows += 1
                on_row(row)
            else:
                print(line, end="", flush=True)
    finally:  # the parent stopped (an exception, a signal): its child does not outlive it
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    code = child.wait()
    run.seconds = time.monotonic() - start
    run.status = "cut at its limit" if cut else "done" if code == 0 else f"failed (exit {code})"
    return run
