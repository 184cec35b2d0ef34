"""gactx refuses a torch older than it supports, at import, with the page that lists what is supported."""

import re
import subprocess
import sys

import pytest

from gactx import _versions


def test_a_release_is_read_from_any_version_string():
    assert _versions.release("2.9.1+cu128") == (2, 9, 1)
    assert _versions.release("2.13.0.dev20261101") == (2, 13, 0)
    assert _versions.release("2.10.0a0+git1234") == (2, 10, 0)


@pytest.mark.parametrize("version", ["2.9.0", "2.9.1+cu128", "2.13.0+cpu", "3.0.0"])
def test_supported_torch_versions_pass(version):
    _versions.check(version)


@pytest.mark.parametrize("version", ["2.8.0", "2.4.1+cpu", "1.13.1"])
def test_an_older_torch_is_refused_with_the_page_that_says_what_is_supported(version):
    wanted = rf"gactx needs torch 2\.9 or later; this is torch {re.escape(version)} .*#supported-versions"
    with pytest.raises(ImportError, match=wanted):
        _versions.check(version)


def test_importing_gactx_under_an_older_torch_raises_before_anything_else():
    code = "import torch\ntorch.__version__ = '2.8.0'\nimport gactx\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "ImportError: gactx needs torch 2.9 or later; this is torch 2.8.0" in done.stderr
