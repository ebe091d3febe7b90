"""The benchmark report: a markdown table with the machine and command, and a PNG plot."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import safetensors
import tensordict
import torch

__all__ = ["grouped_bars", "machine", "pyplot", "summarise", "write_report"]


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "label": f"{platform.machine()}-{os.cpu_count()}c-{round(ram)}g",
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ram": f"{ram:.1f} GiB",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "safetensors": safetensors.__version__,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Medians and ratios: against raw_p2p (the transport's limit) and gather_object, same world and workload."""
    med = {(r["world"], r["workload"], r["method"]): statistics.median(r["times"]) for r in rows if r.get("times")}
    out = []
    for r in rows:
        s = dict(r)
        if r.get("times"):
            key = (r["world"], r["workload"])
            t = med[(*key, r["method"])]
            s["median"] = t
            s["mb_s"] = r["received"] / 1e6 / t if t else 0.0
            raw = med.get((*key, "disk_raw" if r["method"] == "tdgather_collector" else "raw_p2p"))
            s["vs_raw"] = med[(*key, "raw_p2p")] / t if (*key, "raw_p2p") in med else None
            s["vs_disk"] = raw / t if r["method"] == "tdgather_collector" and raw else None
            s["vs_gather_object"] = med[(*key, "gather_object")] / t if (*key, "gather_object") in med else None
            s["mem_x"] = statistics.median(r["peaks"]) / r["received"] if r["peaks"] and r["received"] else None
            s["close"] = statistics.median(r["closes"]) if r.get("closes") else None
        out.append(s)
    return out


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def write_report(
    rows: list[dict], out_dir: Path, command: str, scale: float, repeats: int, budget_mib: int, seconds: float
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    m = machine()
    date = _dt.date.today().isoformat()
    stem = out_dir / f"{date}-{m['label']}{'-quick' if scale < 1 else ''}"
    summary = summarise(rows)
    lines = [
        f"# tdgather benchmark, {date}, {m['label']}",
        "",
        f"- command: `{command}` (scale {scale}, {repeats} timed repeats after one warm-up; {seconds:.0f} s in all)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}, "
        f"safetensors {m['safetensors']}",
        "- transport: gloo over loopback, every rank a process on this machine",
        "- seconds: rank 0's wall time from a barrier to the method's return on rank 0, median;"
        " MB/s: bytes rank 0 received (other ranks' frames) per second",
        "- vs raw: raw_p2p seconds / method seconds (1.0 = the transport's limit); vs gather_object:"
        " gather_object seconds / method seconds (the speed-up)",
        "- memory: rank 0's peak anonymous resident memory plus the host's shared memory (a result placed in a"
        " memfd, Collector segments) during the first call in a fresh process, above its"
        " value before it, over the bytes received (the result the method returns is included);"
        f" the Collector runs with a {budget_mib} MiB budget and writes to disk (compare with disk_raw)",
        "- disk: what a writing method wrote (tdgather_save, tdgather_collector, torch_save, disk_raw) is deleted after"
        " each call, untimed, so that the page cache reuses its pages as on a host that has run a while (on these VMs"
        " a page the guest never touched costs ~3 ms/MB to write into the first time)",
        "- large_whole is large with each video on one rank (a sampler over videos), an extra to large;"
        " td_gather_and_stack runs only where every sender holds the same count of one layout",
        "- detection: per frame 0-50 boxes, scores and labels (jagged nested tensors) and a 256-float embedding;"
        " MB are frame bytes (no padding, no offsets); pad_all_gather pads each ragged leaf to the largest N_i"
        " on any rank and also gathers the file ids, frame_idx and every N_i",
        "",
    ]
    for world in sorted({r["world"] for r in summary}):
        lines += [
            f"## World size {world}",
            "",
            "| workload | method | seconds | MB/s | vs raw | vs gather_object | memory x received | "
            "close s (Collector) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in (r for r in summary if r["world"] == world):
            if "median" not in s:
                lines.append(
                    f"| {s['workload']} | {s['method']} | "
                    f"{'skipped: ' + s['skipped'] if s.get('skipped') else 'failed: ' + s.get('error', '')}"
                    " | | | | | |"
                )
                continue
            close = None if s["close"] is None else f"{s['close']:.3f} ({100 * s['close'] / s['median']:.1f}%)"
            cells = [
                s["workload"],
                s["method"],
                f"{s['median']:.3f}",
                f"{s['mb_s']:.0f}",
                _fmt(s["vs_raw"], ".2f"),
                _fmt(s["vs_gather_object"], ".1f"),
                _fmt(s["mem_x"], ".2f"),
                close or "—",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    png = _plot(summary, stem.with_suffix(".png"))
    if png:
        lines += [f"![throughput and memory by method]({png.name})", ""]
    md = stem.with_suffix(".md")
    md.write_text("\n".join(lines))
    return md


def pyplot():
    """matplotlib's pyplot on the Agg backend; None, with a printed note, where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tdgather[bench]')")
        return None
    return plt


def grouped_bars(ax, groups: list[str], series: list[str], value: Callable[[str, str], float | None]) -> None:
    """On ``ax``, one bar per (group, series): groups along x, a colour and a legend label per series (missing: 0)."""
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        heights = [value(g, name) or 0 for g in groups]
        ax.bar([i + k * width for i in range(len(groups))], heights, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)


def _plot(summary: list[dict], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    worlds = sorted({r["world"] for r in summary})
    workloads = list(dict.fromkeys(r["workload"] for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    by_key = {(r["world"], r["workload"], r["method"]): r for r in summary}
    fig, axes = plt.subplots(len(worlds), 2, figsize=(16, 4.5 * len(worlds)), squeeze=False)
    for row, world in enumerate(worlds):
        for col, (key, label) in enumerate(
            [("mb_s", "MB/s received by rank 0 (log)"), ("mem_x", "rank 0 peak memory / bytes received")]
        ):
            ax = axes[row][col]
            grouped_bars(ax, workloads, methods, lambda w, m, k=key, n=world: by_key.get((n, w, m), {}).get(k))
            ax.set_title(f"world {world}: {label}")
            if key == "mb_s":
                ax.set_yscale("log")
        axes[row][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
