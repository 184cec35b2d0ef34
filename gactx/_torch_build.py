"""What ``make`` is about to install for torch, said before pip starts: the build (CPU or CUDA), where it comes from
and how much it downloads. ``make`` runs this file by its path, before torch is installed
(``python gactx/_torch_build.py <pip install arguments>``): it imports neither gactx nor torch. It asks pip what it
would install (``pip install --dry-run --report``), so what it says is what pip then takes: a local wheel, a mirror,
PyTorch's CPU index or PyPI's CUDA build. It exits with 1 where pip cannot say (a pip without ``--report``); ``make``
then says what it expects instead."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

CHOOSE = "TORCH_BUILD=cpu or TORCH_BUILD=cuda chooses the build"


def describe(report: dict, size: int | None, machine: str = platform.machine(), system: str = platform.system()) -> str:
    """One line from pip's installation report of torch alone (``--no-deps``): its version and build, where it comes
    from, the bytes of its wheel (``size``, ``None`` where not known) and the NVIDIA packages it requires here."""
    torch = next(i for i in report["install"] if i["metadata"]["name"].lower() == "torch")
    version, url = torch["metadata"]["version"], torch["download_info"]["url"]
    nvidia = [r for r in torch["metadata"].get("requires_dist", []) if r.lower().startswith("nvidia-")]
    nvidia = [r for r in nvidia if _applies(r, machine, system)]
    build = "CUDA" if nvidia or "+cu" in version else "CPU"
    wheel = _format(size) if size else "a wheel of unknown size"
    line = f"installing torch {version}, {build} build, from {_where(url)}: {wheel}"
    if nvidia:
        line += f", and its {len(nvidia)} nvidia-* packages, several GB more; this takes minutes"
    return f"{line}. {CHOOSE}."


def _applies(requirement: str, machine: str, system: str) -> bool:
    """Whether a requirement's environment marker holds for ``machine`` and ``system``, as far as the two decide: the
    NVIDIA packages torch requires name the platform they are for."""
    _, _, marker = requirement.partition(";")
    for name, value in (("platform_machine", machine), ("platform_system", system)):
        for quote in ('"', "'"):
            for op in ("==", "!="):
                for spaced in (f"{name} {op} ", f"{name}{op}"):
                    at = marker.find(spaced + quote)
                    if at >= 0:
                        wanted = marker[at + len(spaced) + 1 :].split(quote)[0]
                        if (wanted == value) != (op == "=="):
                            return False
    return True


def _where(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return f"a local wheel in {os.path.dirname(urllib.parse.unquote(parsed.path))}"
    return parsed.netloc


def _format(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{max(1, round(nbytes / 2**20))} MiB"


def _size(url: str) -> int | None:
    """The bytes at ``url``: a local file's, else by a HEAD request (``None`` where the server does not say)."""
    parsed = urllib.parse.urlparse(url)
    try:
        if parsed.scheme == "file":
            return os.path.getsize(urllib.parse.unquote(parsed.path))
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=5) as response:
            length = response.headers.get("Content-Length")
            return int(length) if length else None
    except (OSError, ValueError):
        return None


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "report.json")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps",
             "--report", path, *args],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0 or not os.path.exists(path):
            return 1
        with open(path) as f:
            report = json.load(f)
    url = next(i["download_info"]["url"] for i in report["install"] if i["metadata"]["name"].lower() == "torch")
    print(describe(report, _size(url)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
