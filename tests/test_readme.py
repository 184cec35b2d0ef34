"""README.md's figures are the committed results': each row of its results table is the row of the results file it
links, and its levels table gives each level's step peak, throughput and training quality as measured."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """``(heading, rows)`` of each markdown table of ``text``, each row a dict from the header's names to its cells."""
    out, heading, lines = [], "", text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            header, rows = [], []
            for name in _cells(line):  # a name met twice (two "vs plain" columns) is the second: "vs plain (2)"
                header.append(name if name not in header else f"{name} (2)")
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, _cells(row), strict=False)))
            out.append((heading, rows))
    return out


def _readme_table(first_header: str) -> list[dict[str, str]]:
    return next(rows for _, rows in _tables((ROOT / "README.md").read_text()) if rows and first_header in rows[0])


def _levels() -> dict[str, dict[str, str]]:
    """The README's levels table, by each level its first cell names (`L2` / `L2.1` / `L2.2`: three keys)."""
    return {name: row for row in _readme_table("level") for name in re.findall(r"`(L[\d.]+)`", row["level"])}


def _gpu_rows(path: Path, heading: str, model: str) -> dict[str, dict[str, str]]:
    """The training table of ``path`` under the heading that starts with ``heading``: method -> row."""
    rows = next(rows for h, rows in _tables(path.read_text()) if h.startswith(heading) and rows and "method" in rows[0])
    return {r["method"]: r for r in rows if r["model"] == model}


def _peak_rows(path: Path, model: str, batch: str) -> dict[str, dict[str, str]]:
    rows = next(rows for _, rows in _tables(path.read_text()) if rows and "fp / peak" in rows[0])
    return {r["method"]: r for r in rows if r["model"] == model and r["batch"] == batch}


def _quality() -> dict[tuple[str, str], float]:
    rows = next(rows for _, rows in _tables((RESULTS / "cpu" / "quality.md").read_text()) if rows)
    return {(r["workload"], r["method"].split()[0]): float(r["vs fp"].rstrip("%")) for r in rows}


H200 = RESULTS / "h200" / "gpu.md"
H100_PEAK = RESULTS / "h100" / "peak.md"


def test_the_results_tables_gpu_rows_are_the_h200_run():
    rows = {r["workload"].split(",")[0]: r for r in _readme_table("workload") if r["device, torch, date"][:4] == "H200"}
    for workload, heading, model in [
        ("Llama-3.2-1B shape", "Llama-3.2-1B shape", "llama-lora"),
        ("ResNet-50", "ResNet-50", "resnet50"),
        ("BERT-large", "BERT-large", "bert-large"),
    ]:
        row, measured = rows[workload], _gpu_rows(H200, heading, model)
        assert row["device, torch, date"] == "H200, torch 2.11.0, 2026-11-28"
        assert "2.11.0" in H200.read_text() and "2026-11-28" in H200.read_text()
        assert row["plain peak"] == f"{measured['plain']['peak GiB']} GiB"
        l1, ckpt = measured["L1"], measured["checkpointing"]
        assert row["gactx L1: peak, throughput"].startswith(f"{l1['peak GiB']} GiB, {l1['vs plain']}")
        assert row["checkpointing: peak, throughput"] == f"{ckpt['peak GiB']} GiB, {ckpt['vs plain']}"
        assert "benchmarks/results/h200/gpu.md" in row["results"]
    resnet, l12 = rows["ResNet-50"], _gpu_rows(H200, "ResNet-50", "resnet50")["L1.2"]
    assert f"(L1.2: {l12['peak GiB']} GiB, {l12['vs plain']})" in resnet["gactx L1: peak, throughput"]


def test_the_results_tables_step_peaks_are_the_h100_run():
    for workload, model, batch in [("BERT-base", "bert-base", "128"), ("ResNet-50", "resnet50", "256")]:
        row = next(r for r in _readme_table("workload") if r["workload"].startswith(f"{workload}, batch {batch}"))
        measured = _peak_rows(H100_PEAK, model, batch)
        assert row["device, torch, date"] == "H100, torch 2.11.0, 2026-11-22"
        assert row["plain peak"] == f"{measured['fp']['peak MiB']} MiB"
        expected = f"{measured['L1']['peak MiB']} MiB (L1.2: {measured['L1.2']['peak MiB']} MiB)"
        assert row["gactx L1: peak, throughput"] == expected
        assert row["checkpointing: peak, throughput"] == f"{measured['checkpoint']['peak MiB']} MiB"
        assert "benchmarks/results/h100/peak.md" in row["results"]


def test_the_results_tables_cpu_row_is_labelled_cpu_and_is_the_quality_run():
    row = next(r for r in _readme_table("workload") if r["workload"].startswith("Llama-style decoder from scratch"))
    assert row["device, torch, date"].startswith("CPU")
    assert "2026-12-06" in row["device, torch, date"] and "2026-12-06" in (RESULTS / "cpu" / "quality.md").read_text()
    assert f"+{_quality()[('decoder', 'L1')]}%" in row["gactx L1: peak, throughput"]


def _percentages(cell: str) -> list[tuple[float, int]]:
    """Each percentage of ``cell`` with its decimals: the README rounds where the results file has more."""
    return [(float(m), len(m.partition(".")[2])) for m in re.findall(r"[+-]\d+(?:\.\d+)?(?=%)", cell)]


def test_the_levels_table_gives_each_levels_training_quality_as_measured_on_the_cpu():
    levels = _levels()
    quality = _quality()
    column = next(k for k in next(iter(levels.values())) if k.startswith("final loss vs plain, CPU"))
    workloads = ("decoder", "llama-lora", "sage", "resnet50")  # the column's order: decoder, LoRA, GraphSAGE, ResNet-50
    for level in ("L1", "L1.1", "L1.2", "L2.2"):
        shown = _percentages(levels[level][column].replace("L2.2:", ""))
        assert len(shown) == 4, (level, levels[level][column])
        for (value, places), workload in zip(shown, workloads, strict=True):
            assert round(quality[(workload, level)], places) == value, (level, workload)


def test_the_levels_table_gives_each_fixed_levels_step_peak_on_the_h100_and_throughput_on_the_h200():
    levels = _levels()
    column = next(k for k in levels["L1"] if k.startswith("step peak lower, H100"))
    bert, resnet = _peak_rows(H100_PEAK, "bert-base", "128"), _peak_rows(H100_PEAK, "resnet50", "256")
    for level in ("L1", "L1.1", "L1.2"):
        assert levels[level][column] == f"{bert[level]['fp / peak']}, {resnet[level]['fp / peak']}"
    speed = next(k for k in levels["L1"] if k.startswith("throughput vs plain, H200"))
    l1 = [float(_gpu_rows(H200, h, m)["L1"]["vs plain"].rstrip("x")) for h, m in
          [("Llama-3.2-1B shape", "llama-lora"), ("ResNet-50", "resnet50"), ("BERT-large", "bert-large")]]  # fmt: skip
    assert levels["L1"][speed] == f"{min(l1):.2f}x to {max(l1):.2f}x"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
