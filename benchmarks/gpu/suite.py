"""Arm 0: the kernel tests on the device, with the Triton its torch pins, before anything is measured.

On a GPU the suite's Triton kernels run natively on CUDA tensors and its CUDA-only tests run instead of skipping
(``tests/conftest.py``); on a CPU (``--tiny``) one short file stands in, so that the arm's code runs in CI. The
ahead-of-time compiles (marked slow) are left to the CPU machines: they need no GPU. The tests run in a child
``pytest`` under the arm's deadline; a run cut by it reports what had finished.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time

import torch

from benchmarks.gpu.harness import ROOT, Deadline, emit

__all__ = ["FILES", "TINY_FILES", "run", "summary"]

FILES = ("tests/kernels", "tests/controller/test_pack.py", "tests/controller/test_lane.py")
TINY_FILES = ("tests/kernels/test_triton.py",)
WORKERS = 8  # of the GPU machine's 16 cores: each worker compiles its own kernels (Triton's JIT, on the host)
END_S = 3  # the child is stopped this long before the arm's deadline, so that its summary is still emitted


def summary(output: str) -> dict[str, int]:
    """The counts of pytest's last line ("3 failed, 120 passed, 4 skipped in 12.3s"), or, for a run stopped before
    it, of its progress characters (``-q``: one a test)."""
    last = [line for line in output.splitlines() if re.search(r"\b(passed|failed|error|errors)\b.* in [\d.]+s", line)]
    if last:
        counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", last[-1])}
        counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
        return {key: counts.get(key, 0) for key in ("passed", "failed", "skipped", "errors")}
    ticks = re.compile(r"[.FsExX]+( +\[ *\d+%\])?")
    progress = "".join(line.split(" [")[0] for line in output.splitlines() if ticks.fullmatch(line))
    return {
        "passed": progress.count("."), "failed": progress.count("F"), "skipped": progress.count("s"),
        "errors": progress.count("E"),
    }  # fmt: skip


def run(device: str, tiny: bool, deadline: Deadline) -> None:
    """Run the tests, emit their counts, and raise where any failed (the arm then fails, its row kept)."""
    files = TINY_FILES if tiny else FILES
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rf", *files]
    if not tiny and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(WORKERS)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, deadline.left() - END_S)
        )
        output, code, stopped = done.stdout + done.stderr, done.returncode, False
    except subprocess.TimeoutExpired as cut:
        output = (cut.stdout or b"").decode() if isinstance(cut.stdout, bytes) else cut.stdout or ""
        code, stopped = None, True
    failures = re.findall(r"^FAILED (\S+)", output, re.MULTILINE)
    import triton

    emit({
        "id": "tests/kernels", "kind": "tests", "arm": "tests", "device": device, "files": list(files),
        "command": shlex.join(["python", *command[1:]]), "torch": torch.__version__, "triton": triton.__version__,
        "seconds": round(time.monotonic() - start, 1), "exit_code": code, "stopped_for_time": stopped,
        **summary(output), "failures": failures[:20], "tail": output[-1500:] if code not in (0, None) else "",
    })  # fmt: skip
    if failures or code not in (0, None):
        raise RuntimeError(
            f"the kernel tests failed on {device} (exit {code}): {', '.join(failures[:5]) or 'see tail'}"
        )
