"""Every figure in a table of benchmarks/RESULTS.md comes from a committed results file (benchmarks/results/*.json).

A figure is sourced when a number in some results file, in the table's unit (seconds as s, ms or us; bytes as
MiB), rounds to it as the table writes it; or, for a ratio (a speedup, "compiled ÷ floor", a range of kernel
ratios), when the quotient of two numbers of one results file does; or when a string of a results file holds it
(an error message). Column headers are labels, not figures. A table whose run left no results file is removed
from RESULTS.md, not kept unchecked; the benchmarks merge into their results files, so a later run of some
parts or configurations keeps the figures RESULTS.md quotes from the others (benchmarks/common.write_json).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# a figure: digits, maybe decimals and an exponent, not part of a name (1b-bf16, SmolLM2-135M, 6a1d188), maybe
# followed by a unit or a ratio's x
FIGURE = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?(?:e-?\d+)?)(?=$|[^\w.]|\.(?!\d)|x\b|us\b|ms\b|s\b|µs|%)")
SCALES = np.array([1, 1e3, 1e6, 1e-3, 2.0 ** -20])  # as stored; s -> ms, ms -> us; s -> us; us -> ms; bytes -> MiB


def leaves(o):
    if isinstance(o, dict):
        for k, v in o.items():
            yield k
            yield from leaves(v)
    elif isinstance(o, list):
        for v in o:
            yield from leaves(v)
    else:
        yield o


def sources() -> dict[str, tuple[np.ndarray, np.ndarray, list[str]]]:
    """Each results file's numbers (in every unit, sorted), ratios of two of them (sorted) and strings."""
    out = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        mine, strings = [], []
        for v in leaves(json.loads(path.read_text())):
            if isinstance(v, str):
                strings.append(v)
                v = re.fullmatch(r"-?\d+(?:\.\d+)?", v.strip()) and float(v)
            if isinstance(v, int | float) and not isinstance(v, bool) and v:
                mine.append(abs(float(v)))
        mine = np.unique(np.array(mine))
        out[path.name] = (np.sort(np.outer(mine, SCALES).ravel()), np.sort((mine[:, None] / mine[None, :]).ravel()),
                          strings)
    return out


def near(sorted_values: np.ndarray, value: float, tol: float) -> bool:
    i = np.searchsorted(sorted_values, value - tol)
    return i < len(sorted_values) and sorted_values[i] <= value + tol


def tables(text: str) -> list[tuple[str, list[str], list[tuple[int, list[str]]]]]:
    """(the text since the heading above it, its header cells, its data rows: line number and cells)."""
    out, section, rows = [], "", []
    for n, line in enumerate(text.splitlines() + [""], start=1):
        if line.startswith("|"):
            rows.append((n, [c.strip() for c in line.strip().strip("|").split("|")]))
            continue
        if rows:
            out.append((section, rows[0][1], rows[2:]))  # rows[1]: |---|
            rows = []
        section = line if line.startswith("#") else section + "\n" + line
    return out


def unsourced(text: str) -> list[str]:
    """The table figures of text (RESULTS.md) that no results file holds. A table's figures are looked for in
    the results files its section names (`results/NAME.json`), else in all of them; a quotient of two numbers
    only in a cell that is a ratio (written with x or ×, or under a header that says ratio, speedup or ÷)."""
    files = sources()
    missing = []
    for section, header, rows in tables(text):
        named = [f for f in files if f in section or f.removesuffix(".json") + ".json" in section]
        named = named or list(files)
        for n, cells in rows:
            for j, cell in enumerate(cells):
                ratio = bool(re.search(r"\d(x|×)", cell)) or (
                    j < len(header) and bool(re.search(r"ratio|speedup|÷|\d / \d", header[j])))
                for m in FIGURE.finditer(cell):
                    figure = m.group(1)
                    mantissa, _, exponent = figure.partition("e")
                    decimals = len(mantissa.partition(".")[2])
                    value, tol = float(figure), 0.5 * 10.0 ** (int(exponent or 0) - decimals) * 1.0001
                    if value == 0 or any(near(files[f][0], value, tol) or (ratio and near(files[f][1], value, tol))
                                         for f in named):
                        continue
                    if any(re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", s) for f in named for s in files[f][2]):
                        continue
                    missing.append(f"RESULTS.md:{n} ({section.splitlines()[0].strip('# ')[:50]}): {figure}")
    return missing


def test_every_figure_in_a_results_table_is_in_a_results_file():
    missing = unsourced(RESULTS.read_text())
    assert not missing, "figures without a source:\n" + "\n".join(missing)


def test_a_figure_that_is_in_no_results_file_is_found():
    """The check can fail: an invented row, a figure off by a unit in its last digit, are both reported."""
    text = RESULTS.read_text()
    marker = next(line for line in text.splitlines() if line.startswith("| tp 2 |") or line.startswith("| demo | 1 |"))
    invented = text.replace(marker, marker + "\n| invented | 123.456 | 7.0001x |", 1)
    found = unsourced(invented)
    assert any(f.endswith(": 123.456") for f in found) and any(f.endswith(": 7.0001") for f in found), found


if __name__ == "__main__":
    print("\n".join(unsourced(RESULTS.read_text())) or "every figure is sourced", file=sys.stderr)


def test_a_benchmark_run_merges_into_its_results_file(tmp_path, monkeypatch):
    """shm_bench.py --parts allreduce once rewrote shm_bench.json with that part alone, and RESULTS.md quoted the
    figures it dropped: write_json keeps every key a run did not write, at every depth."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from common import write_json

    path = tmp_path / "results.json"
    write_json(path, {"cpus": 2, "decode": {"demo / 1 rank": {"decode_ms": 6.9}}})
    write_json(path, {"cpus": 2, "allreduce_us": {"tp 2": {"64 KB shm": 25.3}}})
    write_json(path, {"allreduce_us": {"tp 4": {"64 KB shm": 172.0}}})
    assert json.loads(path.read_text()) == {"cpus": 2, "decode": {"demo / 1 rank": {"decode_ms": 6.9}},
                                            "allreduce_us": {"tp 2": {"64 KB shm": 25.3}, "tp 4": {"64 KB shm": 172.0}}}
