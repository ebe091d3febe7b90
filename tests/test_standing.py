"""``python -m benchmarks.standing`` at a tiny scale: its tables, its ratios, and the two places it rewrites.

The command runs for real (every method in its own local gloo world, through `run_local_world`: a
``file://`` rendezvous, no fixed port, and a timeout per world), into copies of a docs page and a
README that hold the markers. Figures are measured, never asserted; what is checked is the shape.
"""

import re

import pytest

from benchmarks.methods import skip_reason
from benchmarks.standing import BASE, MARKERS, METHODS, WORKLOADS, main

pytestmark = [pytest.mark.world, pytest.mark.timeout(240)]

DOCS = """# Benchmarks

The intro, kept as it is; it quotes `{start}` and `{end}` in a sentence.

{start}
an older standing, to be replaced
{end}

## History

- an older result, kept as it is
"""
README = """# tdgather

{start}
an older headline
{end}

The rest, kept as it is.
"""


def _files(tmp_path):
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text(DOCS.format(start=MARKERS["docs"][0], end=MARKERS["docs"][1]))
    readme.write_text(README.format(start=MARKERS["readme"][0], end=MARKERS["readme"][1]))
    return docs, readme


def _standing(tmp_path, docs, readme, *extra):
    args = ["--quick", "--scale", "0.05", "--repeats", "1", "--timeout", "60", "--out", str(tmp_path / "out")]
    assert main([*args, "--docs", str(docs), "--readme", str(readme), *extra]) == 0


def _between(text: str, markers: tuple[str, str]) -> tuple[str, str, str]:
    head, rest = text.split(markers[0] + "\n")
    middle, tail = rest.split(markers[1])
    return head, middle, tail


def _tables(text: str) -> dict[str, dict[str, list[str]]]:
    """``{workload title: {method: the cells after 'what it does'}}`` of the markdown tables under ### headings."""
    out: dict[str, dict[str, list[str]]] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("### "):
            title = line[4:].split(":")[0]
            out[title] = {}
        elif title and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[title][cells[0].strip("`")] = cells[2:]
    return out


def test_standing_writes_the_tables_and_rewrites_only_between_the_markers(tmp_path):
    docs, readme = _files(tmp_path)
    before_docs, before_readme = docs.read_text(), readme.read_text()
    _standing(tmp_path, docs, readme)

    [results] = (tmp_path / "out").glob("*-standing-quick.md")
    text = results.read_text()
    assert "command: `python -m benchmarks.standing --quick --scale 0.05" in text and "torch 2." in text
    tables = _tables(text)
    assert list(tables) == list(WORKLOADS.values())
    for (workload, title), rows in zip(WORKLOADS.items(), tables.values(), strict=True):
        assert list(rows) == list(METHODS), title  # every method named, in order
        for method, cells in rows.items():
            reason = skip_reason(method, workload)
            if reason:
                assert cells[0] == f"skipped: {reason}"
            else:
                assert re.fullmatch(r"\d+(\.\d+)?(e-\d+)?", cells[0]) and cells[1].endswith("×"), (title, method, cells)

    # a ratio is the method's seconds over tdgather_gather's, both as written in the same file
    large = tables[WORKLOADS["large"]]
    seconds, base = float(large["gather_object"][0]), float(large[BASE][0])
    assert float(large["gather_object"][1].rstrip("×")) == pytest.approx(seconds / base, rel=0.01, abs=0.006)
    assert large[BASE][1] == "1.00×"
    assert "## Raw seconds" in text and f"| 2 | large | {BASE} | " in text

    after_docs, after_readme = docs.read_text(), readme.read_text()
    head, section, tail = _between(after_docs, MARKERS["docs"])
    assert (head, tail) == _between(before_docs, MARKERS["docs"])[::2]  # the text outside is unchanged
    assert section.startswith("## Current standing\n") and results.name in section
    assert "python -m benchmarks.standing --quick" in section and "Not the default command" in section
    assert _tables(section) == tables  # the docs show the results file's tables
    head, line, tail = _between(after_readme, MARKERS["readme"])
    assert (head, tail) == _between(before_readme, MARKERS["readme"])[::2]
    assert line.count("\n") == 1 and line.startswith("On 2 ranks of a ") and "`gather_object`" in line

    # a second run replaces the section and the headline, it does not add to them
    _standing(tmp_path, docs, readme, "--workloads", "tiny")
    again = docs.read_text()
    assert again.count("## Current standing") == 1 and again.splitlines().count(MARKERS["docs"][0]) == 1
    assert list(_tables(_between(again, MARKERS["docs"])[1])) == [WORKLOADS["tiny"]]
    assert _between(again, MARKERS["docs"])[::2] == _between(before_docs, MARKERS["docs"])[::2]
    head, line, tail = _between(readme.read_text(), MARKERS["readme"])
    assert line.count("\n") == 1 and "older headline" not in line


def test_a_file_without_the_markers_is_refused(tmp_path):
    from benchmarks.standing import replace_between

    with pytest.raises(ValueError, match="markers"):
        replace_between("no markers here\n", *MARKERS["docs"], "body")
    text = replace_between("a\n<!-- s -->\nold\n<!-- e -->\nb\n", "<!-- s -->", "<!-- e -->", "new")
    assert text == "a\n<!-- s -->\nnew\n<!-- e -->\nb\n"
