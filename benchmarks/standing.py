"""``python -m benchmarks.standing``: where tdgather stands today, one table per workload, from one command.

Every (world size, workload, method) runs in a fresh local gloo world, as `benchmarks.suite` runs it
(`benchmarks.suite.run_suite`: the rank data built untimed, one warm-up call, then ``--repeats`` timed
calls; rank 0's wall time from a barrier to the method's return on rank 0). Each table compares
tdgather with what users do today (``gather_object``, pad + ``all_gather``, tensordict's remote
gathers, a ``torch.save`` per rank) and with the machine's limits (``raw_p2p``, ``disk_raw``).

Every ratio is a method's median seconds over ``tdgather_gather``'s median seconds, in the same
workload and world size: above 1 the method is slower than tdgather, below 1 faster.

The command writes ``<out>/<date>-<machine>-standing.md`` (the machine, the versions, the exact
command, every timed call's seconds and the tables) and a PNG plot beside it (with matplotlib), then
rewrites the section of ``--docs`` between ``<!-- standing:start -->`` and ``<!-- standing:end -->``
and the line of ``--readme`` between ``<!-- headline:start -->`` and ``<!-- headline:end -->``;
nothing else in either file.

Run ``python -m benchmarks.standing --help``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .methods import skip_reason
from .report import grouped_bars, machine, pyplot
from .suite import run_suite
from .workloads import describe

__all__ = [
    "BASE",
    "MARKERS",
    "METHODS",
    "PRESETS",
    "WORKLOADS",
    "Run",
    "headline",
    "main",
    "medians",
    "replace_between",
]

ROOT = Path(__file__).resolve().parents[1]
BASE = "tdgather_gather"  # every ratio is a method's seconds over this one's
# method -> what it does: the tables' rows, in this order
METHODS = {
    "tdgather_gather": "tdgather: `gather` of a `FrameStore` filled during the loop",
    "tdgather_store": "tdgather: `FrameStore.add` per batch (a copy), then `gather`",
    "tdgather_collector": "tdgather: `Collector`, streamed to disk as one dataset (fsynced)",
    "tdgather_dict": "tdgather: `gather` of the dict `{filename: [(frame_idx, frame), ...]}`, each frame its own",
    "gather_object": "`torch.distributed.gather_object` (pickle)",
    "pad_all_gather": "pad to the largest rank, `all_gather`, trim (torchmetrics, accelerate)",
    "td_remote": "tensordict: `init_remote` / `from_remote_init`",
    "td_sorted": "tensordict by hand: `init_remote`, then rank 0 sorts the rows by (file, frame_idx)",
    "torch_save": "a `torch.save` per rank, fsynced: writes N files, no ordering",
    "raw_p2p": "limit: raw `send` / `recv` of the same bytes",
    "disk_raw": "limit: one sequential write + fsync of the same bytes",
}
# workload -> its table's title
WORKLOADS = {
    "large": "Large frames",
    "tiny": "Tiny frames",
    "detection": "Detection outputs (ragged)",
    "per_image": "One frame per filename",
}
# preset -> world sizes, timed repeats, and each workload's scale (of benchmarks.workloads' sizes)
# (the default takes about 5 minutes on 2 cores, gather_object most of it; quick about 1)
PRESETS = {
    "default": {
        "worlds": [2, 4],
        "repeats": 3,
        "scales": {"large": 0.5, "tiny": 0.1, "detection": 1.0, "per_image": 1.0},
    },
    "quick": {
        "worlds": [2],
        "repeats": 2,
        "scales": {"large": 0.1, "tiny": 0.025, "detection": 0.25, "per_image": 0.25},
    },
}
MARKERS = {
    "docs": ("<!-- standing:start -->", "<!-- standing:end -->"),
    "readme": ("<!-- headline:start -->", "<!-- headline:end -->"),
}
ANCHOR = "current-standing"  # the docs section's heading, "## Current standing"
BUDGET = 256 << 20  # the Collector's memory budget, as in the suite


@dataclass
class Run:
    """One run of the command: its rows (`run_suite`'s, each with its workload's scale) and how it was made."""

    rows: list[dict]
    command: str
    repeats: int
    date: str
    default: bool  # the default command (full workloads, every world size): figures to quote
    seconds: float = 0.0


def measure(worlds: list[int], scales: dict[str, float], repeats: int, timeout: float) -> list[dict]:
    """Every (world, workload, method) in a fresh local world (`run_suite`); one row each, with its scale."""
    rows = []
    for workload, scale in scales.items():
        for row in run_suite(worlds, [workload], list(METHODS), scale, repeats, BUDGET, timeout):
            rows.append(row | {"scale": scale})
    return rows


def medians(rows: list[dict]) -> dict[tuple[int, str, str], float]:
    """``{(world, workload, method): median seconds}`` of the rows that ran."""
    return {(r["world"], r["workload"], r["method"]): statistics.median(r["times"]) for r in rows if r.get("times")}


def ratio(med: dict, world: int, workload: str, method: str) -> float | None:
    """A method's median seconds over tdgather_gather's, same world and workload; None where either is missing."""
    base, t = med.get((world, workload, BASE)), med.get((world, workload, method))
    return t / base if t is not None and base else None


def _seconds(t: float) -> str:
    return f"{t:.4g}"


def _times(r: float) -> str:
    """A ratio with about three significant digits."""
    return f"{r:.2f}" if r < 10 else f"{r:.1f}" if r < 100 else f"{r:.0f}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _world_cells(row: dict | None, med: dict, world: int, workload: str, method: str) -> list[str]:
    """A method's two cells in one world's columns: its median seconds and its ratio, or why it did not run."""
    if row is None:
        return ["not run", "—"]
    if row.get("error"):
        return [_cell("failed: " + row["error"]), "—"]
    r = ratio(med, world, workload, method)
    return [_seconds(med[(world, workload, method)]), "—" if r is None else _times(r) + "×"]


def table(rows: list[dict], workload: str) -> list[str]:
    """One workload's markdown table: a row per method, seconds and the ratio in each world size's columns."""
    worlds = sorted({r["world"] for r in rows if r["workload"] == workload})
    scale = next(r["scale"] for r in rows if r["workload"] == workload)
    by_key = {(r["world"], r["workload"], r["method"]): r for r in rows}
    med = medians(rows)
    lines = [
        f"### {WORKLOADS[workload]}: {describe(workload, scale)}",
        "",
        "| method | what it does | " + " | ".join(f"W={w} seconds | W={w} ×" for w in worlds) + " |",
        "|---|---|" + "---:|---:|" * len(worlds),
    ]
    for method, what in METHODS.items():
        skipped = skip_reason(method, workload)
        if skipped:
            cells = [_cell("skipped: " + skipped), *[""] * (2 * len(worlds) - 1)]
        else:
            cells = [
                c for w in worlds for c in _world_cells(by_key.get((w, workload, method)), med, w, workload, method)
            ]
        lines.append(f"| `{method}` | {what} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def tables(rows: list[dict]) -> list[str]:
    """Every workload's table, in WORKLOADS' order."""
    present = {r["workload"] for r in rows}
    return [line for w in WORKLOADS if w in present for line in table(rows, w)]


def convention(repeats: int) -> str:
    """How to read the tables, in one paragraph."""
    return (
        "Seconds: rank 0's wall time from a barrier until it holds every rank's frames (for the writing methods,"
        f" until the files are on disk and fsynced), the median of {repeats} timed call(s) after a warm-up, each"
        " (world size, workload, method) in a fresh local gloo world. **×**: that time over `tdgather_gather`'s in"
        " the same table and world size: above 1 is slower than tdgather, below 1 faster (the limits' rows say how"
        " far tdgather is from the machine)."
    )


def raw_seconds(rows: list[dict]) -> list[str]:
    """Every timed call's seconds, per (world, workload, method): what the tables' medians are taken of."""
    lines = [
        "## Raw seconds",
        "",
        "| world | workload | method | every timed call, seconds | median |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("times"):
            cells = [", ".join(f"{t:.6f}" for t in r["times"]), _seconds(statistics.median(r["times"]))]
        else:
            cells = [_cell(f"skipped: {r['skipped']}" if r.get("skipped") else f"failed: {r.get('error', '')}"), ""]
        lines.append(f"| {r['world']} | {r['workload']} | {r['method']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def plot(rows: list[dict], path: Path) -> Path | None:
    """Bars of every method's time over tdgather_gather's (log), a group per workload, a panel per world size."""
    plt = pyplot()
    if plt is None:
        return None
    med = medians(rows)
    worlds = sorted({r["world"] for r in rows})
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(len(worlds), 1, figsize=(13, 4.5 * len(worlds)), squeeze=False)
    for ax, world in zip((a[0] for a in axes), worlds, strict=True):
        grouped_bars(ax, workloads, list(METHODS), lambda w, m, n=world: ratio(med, n, w, m))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("seconds / tdgather_gather's (log)")
        ax.set_title(f"world size {world}: time relative to tdgather.gather (lower is faster)")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_results(run: Run, out: Path) -> tuple[Path, Path | None]:
    """The results file (machine, versions, command, tables, raw seconds) and its plot, in ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    m = machine()
    stem = out / f"{run.date}-{m['label']}-standing{'' if run.default else '-quick'}"
    rows = run.rows
    png = plot(rows, stem.with_suffix(".png"))
    scales = ", ".join(f"{w} {s:g}" for w, s in dict((r["workload"], r["scale"]) for r in rows).items())
    lines = [
        f"# Where tdgather stands, {run.date}, {m['label']}",
        "",
        f"- command: `{run.command}` ({run.seconds:.0f} s in all)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}, "
        f"safetensors {m['safetensors']}",
        "- transport: gloo over loopback, every rank a process on this machine",
        f"- workload scales (of `benchmarks.workloads`' sizes): {scales}",
        f"- {convention(run.repeats)}",
        "",
        *tables(rows),
        *([f"![time relative to tdgather.gather]({png.name})", ""] if png else []),
        *raw_seconds(rows),
    ]
    md = stem.with_suffix(".md")
    md.write_text("\n".join(lines))
    return md, png


def docs_section(run: Run, md: Path, png: Path | None, docs: Path) -> str:
    """The docs' section: how it was measured and where the results file is, then the tables and the plot."""
    m = machine()
    link = os.path.relpath(md, docs.parent)
    quick = (
        ""
        if run.default
        else (
            " **Not the default command** (smaller workloads or fewer world sizes and repeats): regenerate with"
            " `python -m benchmarks.standing` before quoting these figures."
        )
    )
    lines = [
        "## Current standing",
        "",
        f"Measured {run.date} on `{m['label']}` ({m['cpu']}, {m['cores']} cores, {m['ram']}; torch {m['torch']},"
        f" tensordict {m['tensordict']}), gloo over loopback, every rank a process on this machine, by:",
        "",
        "```bash",
        run.command,
        "```",
        "",
        f"It rewrites this section and the README's headline; the results file, with every timed call's seconds, is"
        f" [{md.name}]({link}).{quick}",
        "",
        convention(run.repeats),
        "",
        *tables(run.rows),
        *([f"![time relative to tdgather.gather]({os.path.relpath(png, docs.parent)})", ""] if png else []),
    ]
    return "\n".join(lines).rstrip("\n")


def _versus(r: float, what: str) -> str:
    return f"{_times(r)}× faster than {what}" if r >= 1 else f"{_times(1 / r)}× slower than {what}"


def headline(rows: list[dict], readme: Path, docs: Path) -> str:
    """The README's one sentence: two or three ratios of the smallest world size's tables, and a link to them."""
    med = medians(rows)
    world = min(r["world"] for r in rows)
    picks = [
        ("large", "large frames", [("gather_object", "`gather_object`"), ("pad_all_gather", "pad + `all_gather`")]),
        ("detection", "detection outputs", [("gather_object", "`gather_object`")]),
    ]
    clauses = []
    for workload, what, against in picks:
        found = [(ratio(med, world, workload, m), name) for m, name in against]
        parts = [_versus(r, name) for r, name in found if r is not None]
        if parts:
            clauses.append(f"{what} {' and '.join(parts)}")
    link = f"{os.path.relpath(docs, readme.parent)}#{ANCHOR}"
    cores = machine()["cores"]
    if not clauses:
        return f"Where tdgather stands against `gather_object` and the other ways: [the tables]({link})."
    return (
        f"On {world} ranks of a {cores}-core machine, tdgather gathers {', and '.join(clauses)} ([the tables]({link}))."
    )


def replace_between(text: str, start: str, end: str, body: str) -> str:
    """``text`` with what lies between the lines ``start`` and ``end`` replaced by ``body`` (markers kept).

    A marker counts only as a whole line (a page may quote it in a sentence); each must be there once.
    """
    lines = [re.compile(rf"^{re.escape(marker)}$", re.M) for marker in (start, end)]
    section = re.compile(rf"^{re.escape(start)}\n.*?^{re.escape(end)}$", re.M | re.S)
    if [len(m.findall(text)) for m in lines] != [1, 1] or not section.search(text):
        raise ValueError(f"the markers {start} and {end} must each be there once, on a line of its own, in this order")
    return section.sub(lambda _: f"{start}\n{body}\n{end}", text, count=1)


def rewrite(path: Path, markers: tuple[str, str], body: str) -> None:
    """Replace the text between ``markers`` in the file at ``path``; nothing else changes."""
    path.write_text(replace_between(path.read_text(encoding="utf-8"), *markers, body), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.standing", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller workloads, world size 2, 2 repeats: about 1 minute"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where the results file goes")
    parser.add_argument(
        "--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="the page whose section is rewritten"
    )
    parser.add_argument("--readme", default=str(ROOT / "README.md"), help="the README whose headline is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="write the results file only")
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 2 4, quick 2)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="default: all four")
    parser.add_argument("--repeats", type=int, help="timed calls after the warm-up (default 3, quick 2)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's scale (tests: small)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one method's world")
    args = parser.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "default"]
    scales = {w: s * args.scale for w, s in preset["scales"].items() if w in (args.workloads or WORKLOADS)}
    repeats = args.repeats or preset["repeats"]
    command = " ".join(["python -m benchmarks.standing", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    default = not (args.quick or args.scale != 1 or args.repeats or args.worlds or args.workloads)
    t0 = time.perf_counter()
    rows = measure(args.worlds or preset["worlds"], scales, repeats, args.timeout)
    run = Run(rows, command, repeats, _dt.date.today().isoformat(), default, time.perf_counter() - t0)
    md, png = write_results(run, Path(args.out))
    print(f"standing: {run.seconds:.0f} s; results: {md}" + (f", plot: {png}" if png else ""))
    if not args.no_docs:
        docs, readme = Path(args.docs), Path(args.readme)
        rewrite(docs, MARKERS["docs"], docs_section(run, md, png, docs))
        rewrite(readme, MARKERS["readme"], headline(rows, readme, docs))
        print(f"rewrote the standing section of {docs} and the headline of {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
