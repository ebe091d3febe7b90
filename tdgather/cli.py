"""The ``tdgather`` command: a thin layer over the library.

``tdgather demo`` runs the demo job on a local CPU world; ``tdgather inspect
PATH`` describes a saved dataset. (The benchmark suite lives in ``benchmarks/`` of a
source checkout: ``python -m benchmarks.suite``; the package never imports it.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import TdgatherError
from .launch import WorldError

__all__ = ["main"]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    print(
        f"tdgather demo: {args.world_size} ranks (gloo, CPU), {args.videos} synthetic videos, writing {args.out}",
        flush=True,
    )
    try:
        s = run_demo(
            args.world_size, args.videos, args.max_frames, args.size, args.batch, args.out, args.seed, args.timeout
        )
    except WorldError as e:  # one line per failed rank: its last line, which names the error
        for rank, failure in sorted(e.failures.items()):
            print(f"tdgather demo: rank {rank}: {failure.strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    per_rank = ", ".join(f"{r}: {n}" for r, n in s["frames_per_rank"].items())
    rows = [
        ("frames", f"{s['frames']} in {s['filenames']} filenames (per rank {per_rank})"),
        ("bytes", _size(s["bytes"])),
        ("duplicates dropped", str(s["duplicates_dropped"])),
        ("loop seconds", f"{s['loop_seconds']:.2f} (rank 0: inference while collecting)"),
        ("close seconds", f"{s['close_seconds']:.3f} (rank 0, after its last batch; waits for slower ranks)"),
        ("collector seconds", f"{s['seconds']:.2f} (open to close, rank 0)"),
        ("wall seconds", f"{s['wall_seconds']:.2f} (with process start)"),
        ("written to", f"{s['out']} ({s['shards']} shard(s) + tdgather.index.json)"),
    ]
    for key, value in rows:
        print(f"  {key:<20}{value}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .reader import Dataset

    ds = Dataset(args.path, incomplete=args.incomplete)
    ds.verify()  # every shard's header, against the index: what open() checks lazily
    names = list(ds)
    shown = names if args.all else names[: args.limit]
    width = min(60, max([len(repr(n)) for n in shown] + [8]))
    print(f"{'filename':<{width}}  {'frames':>7}  layout")
    for name in shown:
        print(f"{name!r:<{width}}  {ds.num_frames(name):>7}  {ds.layout(name).describe()}")
        for leaf, n in ds.lengths(name).items():  # ragged leaves: rows per frame
            spread = f"min {int(n.min())}, mean {float(n.double().mean()):.1f}, max {int(n.max())}"
            print(f"{'':<{width}}  {'':>7}    {leaf}: rows per frame {spread}")
    if len(shown) < len(names):
        print(f"... {len(names) - len(shown)} more (--all shows every filename)")
    m = ds.metadata
    print(
        f"total: {m['num_filenames']} filenames, {m['total_frames']} frames, {_size(m['total_bytes'])} "
        f"in {len(ds.index['shards'])} shard(s)"
    )
    if "failure" in m:
        f = m["failure"]
        print(f"incomplete: saved before {f['type']}" + (f" (rank {f['rank']})" if f["rank"] is not None else ""))
        print(f"  {f['message']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(prog="tdgather", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo job on a local CPU world and save to --out")
    demo.add_argument("--world-size", type=_positive, default=4, help="processes (default 4)")
    demo.add_argument("--videos", type=_positive, default=12, help="synthetic videos (default 12)")
    demo.add_argument("--max-frames", type=_positive, default=40, help="frames of the longest video (default 40)")
    demo.add_argument("--size", type=_positive, default=64, help="frame height and width (default 64)")
    demo.add_argument("--batch", type=_positive, default=16, help="inference batch size (default 16)")
    demo.add_argument("--out", default="out/demo", help="dataset directory, replaced if present (default out/demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds before the job is stopped")
    demo.set_defaults(run=_demo)
    inspect = sub.add_parser("inspect", help="print a saved dataset's filenames, frame counts, shapes and size")
    inspect.add_argument("path")
    inspect.add_argument("--limit", type=int, default=50, help="filenames to list (default 50)")
    inspect.add_argument("--all", action="store_true", help="list every filename")
    inspect.add_argument("--incomplete", action="store_true", help="what a failed run saved in PATH.partial")
    inspect.set_defaults(run=_inspect)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `tdgather inspect ... | head`
        sys.stderr.close()
        return 0
    except (TdgatherError, OSError) as e:
        print(f"tdgather: {e}", file=sys.stderr)
        return 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
