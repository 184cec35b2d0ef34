"""README.md's figures are the committed results': the peak table gives each ratio with gradients zeroed in place and
with gradients set to none (PyTorch's default), read from ``benchmarks/results/cpu/peak.md``."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str) -> list[list[str]]:
    lines = [line.strip() for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_the_readme_peak_table_shows_gradients_zeroed_and_set_to_none_as_measured():
    readme = _rows((ROOT / "README.md").read_text())
    header = next(r for r in readme if r[:2] == ["model", "device"] and any("L1.1" in c for c in r))
    assert header[2:] == ["L1.1 (8 bits), zeroed", "L1.2 (2 bits), zeroed", "L1.1, set to none", "L1.2, set to none"]
    mlp = next(r for r in readme if r[0].startswith("8 x (`Linear(1024, 1024)` + GELU), batch 2048"))
    measured = {
        r[3]: (r[5], r[7])  # method -> (fp / peak, fp / peak with gradients set to none)
        for r in _rows((ROOT / "benchmarks/results/cpu/peak.md").read_text())
        if r[:2] == ["mlp-gelu", "2048"] and r[2].endswith("%")  # the eager table (its saved / fp peak column)
    }
    assert mlp[2:] == [measured["L1.1"][0], measured["L1.2"][0], measured["L1.1"][1], measured["L1.2"][1]]
