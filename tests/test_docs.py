"""The README and the pages of docs/ as a user meets them: every code block runs, every link lands, every figure is a
committed result's, and the pages keep to what they are for.

- ``python`` blocks run, a page's blocks in order in one namespace (a later block may use an earlier one's model), at
  the sizes the page gives, in a scratch folder; they must leave no saved-tensor hooks installed and issue no warning
  of gactx's.
- ``bash`` blocks run line by line, unless the line before the fence marks the block ``<!-- skip: reason -->`` (one
  that needs a GPU, installs packages, or runs for minutes). The marks are few (:data:`MAX_SKIPS`), each gives its
  reason, and a marked block's commands are still checked: each ``make`` target exists, and each ``python -m`` module
  of this repository exists and takes the options the line gives.
- Links between pages and to results, and the ``docs/...`` pages and anchors that gactx's messages name, exist.
- The figures of each page's tables are in the results files its section links to.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import subprocess
import sys
import tokenize
import warnings
from pathlib import Path

import pytest
import torch

import gactx

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
MAX_SKIPS = 12  # blocks that cannot run on a CPU test machine: few, each with its reason
README_LINES, DOCS_LINES = 150, 1500  # the README; docs/ without design-notes.md

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:\s*(\S.*?)\s*-->\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS_REF = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")


def blocks(page: Path) -> list[tuple[str, str, str | None, int]]:
    """``(language, code, skip reason or None, line)`` of each fenced block of ``page``."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        out.append((m.group(1), m.group(2), skip.group(1) if skip else None, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# -- code blocks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [p for p in PAGES if any(b[0] == "python" and not b[2] for b in blocks(p))], ids=_id)
def test_every_python_block_of_a_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    level, rng, threads = gactx.get_optimization_level(), torch.random.get_rng_state(), torch.get_num_threads()
    namespace = {"__name__": f"docs_{page.stem}"}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for language, code, skip, line in blocks(page):
                if language == "python" and not skip:
                    exec(compile(code, f"{_id(page)}, block at line {line}", "exec"), namespace)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "a block left hooks installed"
        ours = [str(w.message) for w in caught if "gactx" in str(w.message) or "/gactx/" in w.filename]
        assert not ours, f"the page's examples warn: {ours}"
    finally:
        gactx.set_optimization_level(level)
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


def _commands(code: str) -> list[list[str]]:
    """The commands of a bash block: each line's ``&&``-separated parts as words, comments and ``VAR=value`` prefixes
    left out."""
    out = []
    for line in code.splitlines():
        for part in re.split(r"&&|;", line):
            words = shlex.split(part, comments=True)
            while words and re.match(r"^\w+=", words[0]):
                words = words[1:]
            if words:
                out.append(words)
    return out


def _module_help(module: str) -> str:
    """``python -m module --help``'s text, run in this process (the modules import what the suite has loaded)."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a package's submodule already imported
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code in (0, None), f"python -m {module} --help exited with {e.code}"
    finally:
        sys.argv = argv
    return out.getvalue()


def _check_command(words: list[str], where: str) -> None:
    """That a command a page gives still names what exists: a Makefile target, a module of this repository and its
    options, a test file."""
    if words[0] == "make":
        for target in words[1:]:
            done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
            assert done.returncode == 0, f"{where}: make {target}: {done.stderr.strip()}"
    elif words[0] in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        module, args = words[2], words[3:]
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        if module == "pytest":
            for arg in args:
                if not arg.startswith("-"):
                    assert (ROOT / arg.split("::")[0]).exists(), f"{where}: no test file {arg}"
        elif module.split(".")[0] in ("gactx", "benchmarks"):
            text = _module_help(module)
            for arg in args:
                if arg.startswith("--"):
                    assert arg.split("=")[0] in text, f"{where}: python -m {module} has no option {arg}"


@pytest.mark.parametrize("page", [p for p in PAGES if any(b[0] == "bash" for b in blocks(p))], ids=_id)
def test_every_bash_block_runs_or_names_what_exists(page):
    for language, code, skip, line in blocks(page):
        if language != "bash":
            continue
        where = f"{_id(page)}:{line}"
        for words in _commands(code):
            _check_command(words, where)
        if not skip:
            done = subprocess.run(["bash", "-e", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{where}: {done.stderr[-2000:]}"


def test_skip_marks_are_few_and_say_why():
    marked = [(p, line, skip) for p in PAGES for _, _, skip, line in blocks(p) if skip]
    assert len(marked) <= MAX_SKIPS, [f"{_id(p)}:{line}" for p, line, _ in marked]
    assert all(len(reason.split()) >= 3 for _, _, reason in marked)
    runnable = [b for p in PAGES for b in blocks(p) if b[0] in ("python", "bash")]
    assert len(runnable) > 2 * len(marked), "most examples must run"


# -- links ------------------------------------------------------------------------------------------------------------


def _check_link(source: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    assert dest.exists(), f"{_id(source)} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{_id(source)} links to {target}: no such heading in {dest.name}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_link_of_a_page_lands(page):
    text = FENCE.sub("", page.read_text())
    targets = [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]
    for target in targets:
        _check_link(page, target)


def test_every_docs_page_and_anchor_the_code_names_exists():
    """gactx's messages and docstrings, and the benchmarks' and tests', name pages as ``docs/<page>.md#<anchor>``."""
    named = 0
    for source in [*ROOT.glob("gactx/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        if source == Path(__file__).resolve():
            continue
        for page, anchor in DOCS_REF.findall(source.read_text()):
            named += 1
            assert (DOCS / page).exists(), f"{source.relative_to(ROOT)} names docs/{page}, which does not exist"
            if anchor:
                assert anchor in anchors(DOCS / page), f"{source.relative_to(ROOT)} names docs/{page}#{anchor}"
    assert named > 10


def test_every_warning_gactx_issues_names_the_page_that_explains_it():
    """Each ``warnings.warn`` in gactx/ carries a ``docs/<page>.md#<anchor>`` in its message's text."""
    calls = 0
    for source in ROOT.glob("gactx/**/*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                calls += 1
                texts = " ".join(
                    c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
                assert DOCS_REF.search(texts) and "#" in texts, (
                    f"{source.relative_to(ROOT)}:{node.lineno}: no docs link"
                )
    assert calls >= 5


# -- what the pages hold ----------------------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])\d+\.\d+|(?<![\w.])\d+(?=\s?(?:x|%)(?!\w))")
NOT_FIGURES = re.compile(r"\d+\.\d+\.\d+|\d{4}-\d\d-\d\d|\bL\d(?:\.\d)?\b|[A-Za-z]+-\d[\w.]*|sm_\d+|`[^`]*`")


def figures(text: str) -> list[str]:
    """The figures of ``text``: numbers with a decimal point, and ratios and percentages (versions, dates, level and
    model names, and code left out)."""
    return NUMBER.findall(NOT_FIGURES.sub(" ", text))


def matches(figure: str, numbers: list[str]) -> bool:
    """Whether ``figure`` is one of ``numbers`` as written, or rounded to its own decimals."""
    places = len(figure.partition(".")[2])
    value = float(figure)
    return any(abs(round(float(n), places) - value) < 1e-9 for n in numbers)


def sections(page: Path) -> list[str]:
    return re.split(r"^## ", FENCE.sub("", page.read_text()), flags=re.M)


def results_linked(section: str, page: Path) -> list[Path]:
    return [(page.parent / t.partition("#")[0]).resolve() for t in LINK.findall(section) if "benchmarks/results/" in t]


# Sections whose tables hold no measurement: options and their defaults, the versions supported, and the format's
# bytes, which test_the_format_table_gives_expected_nbytes computes.
NOT_MEASURED = ("Options", "The format", "Supported versions")


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_the_figures_of_a_pages_tables_are_in_the_results_its_section_links(page):
    """A table row's figures (its first column, the row's name, left out) are figures of the committed results files
    the table's section links to."""
    if page.name == "design-notes.md":
        pytest.skip("the design notes tell history, figures of runs since replaced")
    checked = 0
    for section in sections(page):
        if section.splitlines()[0].strip() in NOT_MEASURED:
            continue
        rows = [line for line in section.splitlines() if line.startswith("|") and not re.match(r"^\|[-:| ]+\|$", line)]
        cells = [c for row in rows[1:] for c in row.strip("|").split("|")[1:]] if rows else []
        wanted = [f for c in cells for f in figures(c)]
        if not wanted:
            continue
        files = results_linked(section, page)
        assert files, f"{_id(page)}: a section with figures links no results file: {section.splitlines()[0]!r}"
        numbers = [n for f in files for n in re.findall(r"\d+\.\d+|\d+", f.read_text())]
        missing = [f for f in wanted if not matches(f, numbers)]
        assert not missing, (
            f"{_id(page)}, section {section.splitlines()[0]!r}: not in {[f.name for f in files]}: {missing}"
        )
        checked += len(wanted)
    if page.name not in ("install.md", "benchmarks.md"):
        assert checked > 0, f"{_id(page)} has no table of figures"


def test_the_format_table_gives_expected_nbytes():
    """docs/kernels.md's table of bytes an element is :func:`gactx.expected_nbytes` of float32 in groups of 256."""
    section = next(s for s in sections(DOCS / "kernels.md") if s.startswith("The format"))
    rows = [r.strip("|").split("|") for r in section.splitlines() if re.match(r"^\| \d+ bits?", r)]
    assert len(rows) == 5
    n = 256 * 1024
    for width, per_element, smaller in rows:
        bits = int(width.split()[0])
        nbytes = gactx.expected_nbytes(n, torch.float32, bits, 256)
        assert matches(per_element.strip(), [str(nbytes / n)]), (width, per_element)
        assert matches(smaller.strip().rstrip("x"), [str(4 * n / nbytes)]), (width, smaller)


def test_the_readme_and_docs_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES
    lines = sum(len(p.read_text().splitlines()) for p in DOCS.glob("*.md") if p.name != "design-notes.md")
    assert lines <= DOCS_LINES


def test_no_run_logs_in_prose():
    """No time of day and no "UTC" in the README and docs; no "UTC" and no date in the docstrings and comments of
    gactx/ and benchmarks/: a measurement there rots."""
    for page in PAGES:
        text = page.read_text()
        assert "UTC" not in text, _id(page)
        assert not re.search(r"\b\d{1,2}:\d\d\b", FENCE.sub("", text)), f"{_id(page)}: a time of day"
    for source in [*ROOT.glob("gactx/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]:
        prose = _docstrings_and_comments(source)
        assert "UTC" not in prose, source.relative_to(ROOT)
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", prose), f"{source.relative_to(ROOT)}: a dated note"


def _docstrings_and_comments(source: Path) -> str:
    text = source.read_text()
    parts = [ast.get_docstring(n, clean=False) or "" for n in ast.walk(ast.parse(text)) if _has_docstring(n)]
    with io.StringIO(text) as f:
        parts += [t.string for t in tokenize.generate_tokens(f.readline) if t.type == tokenize.COMMENT]
    return "\n".join(parts)


def _has_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
