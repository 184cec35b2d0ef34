"""Which device a benchmark ran on, in words for its tables and as a folder name for its results."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

__all__ = ["device_name", "device_slug"]


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model with its cores and torch threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor()
    if not model and Path("/proc/cpuinfo").exists():
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        model = found.group(1).strip() if found else ""
    model = model or platform.machine() or "unknown"
    return f"CPU: {model} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def device_slug(device: str) -> str:
    """A folder name: "cpu", or the GPU's model ("NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA L40S" -> "l40s")."""
    if device == "cpu":
        return "cpu"
    words = torch.cuda.get_device_name().replace("NVIDIA", "").split()
    model = next((w for w in words if re.fullmatch(r"[A-Za-z]+\d+[A-Za-z]*", w)), None)
    return (model or "-".join(words) or "cuda").lower()
