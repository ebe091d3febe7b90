"""The seed scenario: a conv model over a shuffled, padded DistributedSampler, and six ways to keep its outputs.

Run (the committed CPU result; on a GPU machine the same command runs the model on the GPUs):

    python -m benchmarks.seed --world 2 --videos 15 --frames 41 --size 64 --batch 16 --repeats 2 --rounds 3

``--quick`` is a tiny run (a smoke test: 15 frames of 16 x 16, one world per method, one timed run);
``--device cpu`` keeps the model on the CPU where CUDA is available. ``--rounds`` starts that many
fresh worlds per method, taking the methods in turn, so that a busy spell on a shared machine
lands on every method alike; each world times ``--repeats`` runs.

Every rank runs the same inference job: ``--videos`` videos of ``--frames`` frames (each a
``3 x size x size`` image made from a seed in the Dataset), a ``DistributedSampler(shuffle=True,
drop_last=False)`` that pads the last round with repeats of the first frames, a DataLoader of
``--batch`` and a small conv net whose output per frame is a ``channels x size x size`` float32 map
(a segmentation head). Methods, each in fresh local worlds (their own processes, so memory
high-water marks are their own):

- ``loop``: the inference loop alone, outputs dropped (the baseline);
- ``collector``: a `tdgather.Collector` fed each batch in the loop, writing the dataset on rank 0;
- ``collector_1thread``: the same with ``write_threads=1`` (by default rank 0 writes as many shards
  at once as a quarter of its cores, 1 to 4: 1 on 2 cores); ``collector_8threads``: ``write_threads=8``;
- ``gather_save``: a `tdgather.FrameStore` fed in the loop, then `tdgather.gather` and `tdgather.save`;
- ``gather_object``: the outputs kept as they come (CUDA tensors on a GPU), then
  ``torch.distributed.gather_object`` to rank 0 (pickled; unpickled onto the GPUs they came from);
- ``cpu_gather_object``: ``.cpu()`` of each batch's output, then ``gather_object`` (on the CPU the two
  are the same);
- ``torch_save``: ``.cpu()`` of each batch's output, then one ``torch.save`` per rank of its list.

Reported for rank 0: seconds from a barrier before the loop to a barrier after the method (every rank
done: rank 0 holds or has written everything), median of every timed run; the resident-memory
high-water mark (``VmHWM``, reset with ``/proc/self/clear_refs`` after the model and data are
ready), and how far it rose above the resident memory at that reset; on CUDA,
``torch.cuda.max_memory_allocated``; each as a ratio to ``loop``. Then, untimed, the frames each
method produced (distinct ``(filename, frame_idx)``: a dataset's frames, the frames in what
``gather_object`` returned or in the ``torch.save`` files, and for ``loop`` the frames the samplers
gave); every method must give every frame of the job.

``gather_object`` and ``torch.save`` pickle; they are the baselines, measured here only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import tdgather
from tdgather.tools.launch import WorldError, run_local_world

from .report import machine

__all__ = ["METHODS", "SegNet", "VideoFrames", "main"]

METHODS = [
    "loop",
    "collector",
    "collector_1thread",
    "collector_8threads",
    "gather_save",
    "gather_object",
    "cpu_gather_object",
    "torch_save",
]
QUICK = {"videos": 3, "frames": 5, "size": 16, "batch": 4, "repeats": 1, "rounds": 1}
MIB = 1 << 20


class VideoFrames(Dataset):
    """``videos x frames`` samples: ``{"filename", "frame_idx", "image"}``, each image made from a seed."""

    def __init__(self, videos: int, frames: int, size: int, seed: int) -> None:
        self.videos, self.frames, self.size, self.seed = videos, frames, size, seed

    def __len__(self) -> int:
        return self.videos * self.frames

    def key(self, i: int) -> tuple[str, int]:
        """Sample ``i``'s ``(filename, frame_idx)``."""
        v, t = divmod(i, self.frames)
        return f"video_{v:04d}.mp4", t

    def __getitem__(self, i: int) -> dict[str, Any]:
        name, t = self.key(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"filename": name, "frame_idx": t, "image": torch.rand(3, self.size, self.size, generator=g)}


class SegNet(nn.Module):
    """A small conv net: ``[B, 3, H, W]`` images to ``[B, channels, H, W]`` maps."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(16, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The per-pixel maps of a batch."""
        return self.head(self.body(x))


# ---- the methods: each runs the loop on every rank and returns what rank 0 then checks ------------


def _loop(job: dict, keep: Any) -> None:
    """The inference loop; ``keep(filenames, frame_idx, output)`` is called per batch."""
    with torch.inference_mode():
        for batch in job["loader"]:
            y = job["model"](batch["image"].to(job["device"], non_blocking=True))
            keep(batch["filename"], batch["frame_idx"], y)


def run_loop(job: dict, out: str) -> Any:
    _loop(job, lambda names, idx, y: None)
    return None


def run_collector(job: dict, out: str, write_threads: int | None = None) -> Any:
    with tdgather.Collector(out, timeout=job["timeout"], progress=False, write_threads=write_threads) as col:
        _loop(job, col.add)
    return None


def run_gather_save(job: dict, out: str) -> Any:
    store = tdgather.FrameStore()
    _loop(job, store.add)
    gathered = tdgather.gather(store, timeout=job["timeout"])
    if gathered is not None:
        tdgather.save(gathered, out)
    return None


def _gather_object(job: dict, kept: list) -> list | None:
    got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(kept, got, dst=0)
    return got


def run_gather_object(job: dict, out: str) -> Any:
    kept: list = []
    _loop(job, lambda names, idx, y: kept.append((names, idx.tolist(), y)))
    return _gather_object(job, kept)


def run_cpu_gather_object(job: dict, out: str) -> Any:
    kept: list = []
    _loop(job, lambda names, idx, y: kept.append((names, idx.tolist(), y.cpu())))
    return _gather_object(job, kept)


def run_torch_save(job: dict, out: str) -> Any:
    kept: list = []
    _loop(job, lambda names, idx, y: kept.append((names, idx.tolist(), y.cpu())))
    os.makedirs(out, exist_ok=True)
    torch.save(kept, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    return None


RUN = {
    "loop": run_loop,
    "collector": run_collector,
    "collector_1thread": lambda job, out: run_collector(job, out, write_threads=1),
    "collector_8threads": lambda job, out: run_collector(job, out, write_threads=8),
    "gather_save": run_gather_save,
    "gather_object": run_gather_object,
    "cpu_gather_object": run_cpu_gather_object,
    "torch_save": run_torch_save,
}


def _frames_made(method: str, job: dict, result: Any, out: str) -> int | None:
    """Untimed: the distinct ``(filename, frame_idx)`` the method produced (on rank 0; None elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if method == "loop":  # what the samplers gave (the same order the loop ran: no set_epoch)
        mine = [job["data"].key(i) for i in job["sampler"]]
        every = [None] * world if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        return len({k for keys in every for k in keys}) if rank == 0 else None
    if rank != 0:
        return None
    keys: set = set()
    if method in ("collector", "collector_1thread", "collector_8threads", "gather_save"):
        ds = tdgather.open(out)
        for name in ds:
            f = ds[name]
            assert f.frames.shape[1:] == job["frame_shape"], (name, f.frames.shape)
            keys.update((name, i) for i in f.frame_idx.tolist())
    else:
        if method == "torch_save":
            parts = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(world)]
        else:
            parts = result
        for part in parts:
            for names, idx, y in part:
                assert tuple(y.shape[1:]) == job["frame_shape"] and y.shape[0] == len(names), y.shape
                keys.update(zip(names, idx, strict=True))
    return len(keys)


# ---- one method in one world ---------------------------------------------------------------------------


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmHWM``, ``VmRSS``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_high_water() -> bool:
    """Reset ``VmHWM`` to the current resident memory (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _rank(method: str, cfg: dict, scratch: str) -> dict | None:
    """Run ``method`` ``cfg["repeats"]`` times on this rank; rank 0 returns its figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # ranks share the GPUs when there are more ranks
    data = VideoFrames(cfg["videos"], cfg["frames"], cfg["size"], cfg["seed"])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"], drop_last=False)
    loader = DataLoader(data, batch_size=cfg["batch"], sampler=sampler, pin_memory=cuda)
    torch.manual_seed(cfg["seed"])  # the same weights on every rank
    model = SegNet(cfg["channels"]).to(device).eval()
    job = {
        "data": data,
        "sampler": sampler,
        "loader": loader,
        "model": model,
        "device": device,
        "timeout": cfg["timeout"],
        "frame_shape": (cfg["channels"], cfg["size"], cfg["size"]),
    }
    with torch.inference_mode():  # warm-up: kernels chosen, CUDA context made, before anything is measured
        model(torch.zeros(cfg["batch"], 3, cfg["size"], cfg["size"], device=device))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gc.collect()
    reset = _reset_high_water()
    start_rss = _status("VmRSS")
    times, frames = [], []
    for repeat in range(cfg["repeats"]):
        out = os.path.join(scratch, f"{method}-{repeat}")
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        result = RUN[method](job, out)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peak_rss = _status("VmHWM")  # before the untimed check below reads anything back
        peak_gpu = torch.cuda.max_memory_allocated() if cuda else None
        frames.append(_frames_made(method, job, result, out))
        del result
        dist.barrier()
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)  # untimed; the next repeat writes into recycled pages
    if rank != 0:
        return None
    return {
        "method": method,
        "seconds": statistics.median(times),
        "times": times,
        "peak_rss": peak_rss,
        "start_rss": start_rss,
        "hwm_reset": reset,
        "peak_gpu": peak_gpu,
        "frames": frames,
        "frames_run": len(sampler) * world,  # padding included
    }


def _combine(method: str, runs: list[dict]) -> dict:
    """One row of a method's rounds: the median of every timed run, the highest peaks, every frame count."""
    failed = [r for r in runs if "seconds" not in r]
    if failed:
        return failed[0]
    times = [t for r in runs for t in r["times"]]
    gpu = [r["peak_gpu"] for r in runs if r["peak_gpu"] is not None]
    return {
        "method": method,
        "seconds": statistics.median(times),
        "times": times,
        "peak_rss": max(r["peak_rss"] for r in runs),
        "above": max(r["peak_rss"] - r["start_rss"] for r in runs),
        "hwm_reset": all(r["hwm_reset"] for r in runs),
        "peak_gpu": max(gpu) if gpu else None,
        "frames": [f for r in runs for f in r["frames"]],
    }


# ---- the report ----------------------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "—"


def write_report(
    rows: list[dict], cfg: dict, command: str, out_dir: Path, seconds: float, load: tuple[float, ...]
) -> Path:
    """The markdown table (machine, versions, date and command first) in ``out_dir``; ``load``: the load before."""
    m = machine()
    date = dt.date.today().isoformat()
    label = m["label"] + ("-cuda" if cfg["device"] == "cuda" else "")
    path = out_dir / f"{date}-{label}-seed{'-quick' if cfg['quick'] else ''}.md"
    cuda = cfg["device"] == "cuda"
    gpu = f"; GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}" if cuda else "; no GPU used"
    frame_mb = cfg["channels"] * cfg["size"] ** 2 * 4 / 1e6
    total = cfg["videos"] * cfg["frames"]
    lines = [
        f"# The seed scenario, {date}, {label}",
        "",
        f"- command: `{command}` ({seconds:.0f} s in all)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}{gpu}",
        f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}, "
        f"safetensors {m['safetensors']}, tdgather {getattr(tdgather, '__version__', '?')}",
        f"- job: world {cfg['world']} (a local gloo world; the model on {cfg['device']}), {cfg['videos']} videos x "
        f"{cfg['frames']} frames = {total} frames, 3x{cfg['size']}x{cfg['size']} images, batches of {cfg['batch']} "
        f"from a shuffled DistributedSampler (drop_last=False: {-total % cfg['world']} padding repeat(s)); "
        f"output float32 [{cfg['channels']}, {cfg['size']}, {cfg['size']}] a frame "
        f"({frame_mb:.3f} MB; {frame_mb * total:.1f} MB in all)",
        f"- seconds: rank 0, from a barrier before the loop to a barrier after the method, median (min-max) of "
        f"{cfg['repeats']} timed runs (after a warm-up forward) in each of {cfg['rounds']} fresh world(s) per method,"
        f" the methods taken in turn; x loop: median over the loop alone's; load average (1 min) "
        f"{load[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        "- peak RSS: rank 0's VmHWM during the timed runs (reset after the model and data were ready); above start:"
        " that minus the resident memory at the reset; GPU peak: torch.cuda.max_memory_allocated on rank 0;"
        " each the highest of the worlds",
        "- frames: distinct (filename, frame_idx) the method produced, checked untimed (the loop: the samplers'),"
        f" after each timed run; the job has {total}",
        "- gather_object and cpu_gather_object hold the result in rank 0's memory and write nothing;"
        " collector and gather_save write a tdgather dataset; torch_save writes one file per rank",
        "",
        "| method | seconds | x loop | peak RSS MiB | x loop | above start MiB | x loop | GPU peak MiB | x loop "
        "| frames |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r for r in rows if r["method"] == "loop" and "seconds" in r), None)
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['method']} | failed: {r['error']} | | | | | | | | |")
            continue
        above = r["above"]
        gpu_mib = r["peak_gpu"] / MIB if r["peak_gpu"] is not None else None
        cells = [
            r["method"],
            f"{r['seconds']:.3f} ({min(r['times']):.3f}-{max(r['times']):.3f})",
            _ratio(r["seconds"], base and base["seconds"]),
            f"{r['peak_rss'] / MIB:.0f}",
            _ratio(r["peak_rss"], base and base["peak_rss"]),
            f"{above / MIB:.0f}",
            _ratio(above, base and base["above"]),
            "—" if gpu_mib is None else f"{gpu_mib:.0f}",
            _ratio(r["peak_gpu"], base and base["peak_gpu"]),
            "/".join(str(f) for f in sorted(set(r["frames"]))),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if not all(r.get("hwm_reset", True) for r in rows):
        lines += ["", "VmHWM could not be reset here: the peaks are since each rank's process started."]
    lines.append("")
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    """Run every method in its own world and write the report; 0 when every one ran and made every frame."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.seed", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--videos", type=int, default=15)
    p.add_argument("--frames", type=int, default=41, help="frames per video")
    p.add_argument("--size", type=int, default=64, help="image height and width")
    p.add_argument("--channels", type=int, default=8, help="output maps per frame")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs in each world")
    p.add_argument("--rounds", type=int, default=1, help="fresh worlds per method, the methods taken in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    p.add_argument("--quick", action="store_true", help=f"a tiny run: {QUICK}")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for each method's world")
    p.add_argument("--out", default="benchmarks/results", help="where the markdown report goes")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    cfg = {
        "world": args.world,
        "videos": args.videos,
        "frames": args.frames,
        "size": args.size,
        "channels": args.channels,
        "batch": args.batch,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "seed": args.seed,
        "device": device,
        "quick": args.quick,
        "timeout": args.timeout,
    }
    total = args.videos * args.frames
    start, load = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict]] = {}
    scratch = tempfile.mkdtemp(prefix="tdgather-seed-")
    try:
        for rnd in range(args.rounds):  # round-robin: a busy spell on a shared machine hits every method alike
            for method in args.methods:
                try:
                    row = run_local_world(_rank, args.world, method, cfg, scratch, timeout=args.timeout + 60)[0]
                except WorldError as e:
                    reason = next(iter(e.failures.values()), str(e)).strip().splitlines()[-1]
                    row = {"method": method, "error": reason[:200]}
                runs.setdefault(method, []).append(row)
                shown = f"{row['seconds']:.3f} s, frames {row['frames']}" if "seconds" in row else row["error"]
                print(f"round {rnd + 1}, {method}: {shown}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = [_combine(method, runs[method]) for method in args.methods]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.seed" + (" " + shlex.join(argv) if argv else "")
    report = write_report(rows, cfg, command, out_dir, time.perf_counter() - start, load)
    print(report.read_text())
    print(f"written to {report}")
    ok = all("seconds" in r and set(r["frames"]) == {total} for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
