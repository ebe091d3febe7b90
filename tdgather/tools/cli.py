"""The ``tdgather`` command: a thin layer over the library.

``tdgather demo`` runs the demo job on a local CPU world; ``tdgather inspect
PATH`` describes a saved dataset (``--frames FILENAME``: one filename's frames and
value statistics); ``tdgather snapshots PATH`` lists the snapshots of a dataset that
jobs append to, one line each (``tdgather compact PATH`` rewrites the newest into fewer shards,
``tdgather expire PATH`` removes old ones); ``tdgather export-hf PATH OUT`` writes it as a Hugging Face
``datasets`` dataset (``--parquet``: Parquet shards). (The benchmark suite lives in ``benchmarks/`` of a
source checkout: ``python -m benchmarks.suite``; the package never imports it.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TdgatherError
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
    from ..storage.reader import Dataset

    # --frames reads values: as TensorDicts, so that a tensorclass this process cannot import is no warning
    ds = Dataset(args.path, args.incomplete, args.storage_options, tensorclass=args.frames is None)
    checked = ds.verify(checksums=args.verify)  # every header, against the index; --verify: every byte too
    status = _report_verified(ds, args, checked) if args.verify else 0
    if args.frames is not None:
        return _inspect_frames(ds, args.frames) or status
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
    _print_schema(ds)
    _print_shards(ds, args.all)
    _print_duplicates(m)
    _print_attempts(m)
    if "failure" in m:
        f = m["failure"]
        print(f"incomplete: saved before {f['type']}" + (f" (rank {f['rank']})" if f["rank"] is not None else ""))
        print(f"  {f['message']}")
    return status


def _report_verified(ds: Any, args: argparse.Namespace, checked: int) -> int:
    """Say how many shards ``--verify`` read whole against their checksum; 1 where some could not be."""
    total = len(ds.index["shards"])
    opened = f"tdgather.open({args.path!r}{', incomplete=True' if args.incomplete else ''})"
    print(f"verified: {checked} of {total} shard(s): every byte matches the checksum the index records")
    if checked == total:
        return 0
    print(
        f"tdgather: --verify: {total - checked} of {total} shard(s) NOT verified: the index lists no checksum "
        "for them (a local dataset written by a tdgather before index version 7, or a failed run's shards that "
        "no record lists), so only their header and size were checked, not their content. To have every byte "
        f"checked, write the dataset again: tdgather.save({opened}, NEW_PATH)",
        file=sys.stderr,
    )
    return 1


def _print_schema(ds: Any) -> None:
    """The dataset's frame types (``*``: a ragged leaf's rows per frame) and how many filenames have each."""
    count = Counter(ds.layout(name) for name in ds)
    print(f"schema: {len(ds.schema)} type(s) of frame")
    for t in ds.schema:
        print(f"  {t.describe()}  ({count[t]} filename(s))")


def _print_shards(ds: Any, every: bool, limit: int = 10) -> None:
    """One line per shard: its frames, bytes and groups (the first ``limit`` unless ``every``)."""
    shards = ds.index["shards"]
    for name in list(shards)[: None if every else limit]:
        entry = shards[name]
        groups = ", ".join(entry["groups"])
        print(f"  {name}  {entry['frames']:>7} frames  {_size(entry['bytes']):>9}  groups {groups}")
    if not every and len(shards) > limit:
        print(f"  ... {len(shards) - limit} more shard(s) (--all shows every shard)")


def _print_duplicates(m: dict) -> None:
    """The duplicate copies dropped while gathering, as the index metadata records them (if it does)."""
    d = m.get("duplicates")
    if not isinstance(d, dict):
        return
    dropped = m.get("duplicates_dropped", d.get("exact", 0) + d.get("inexact", 0))
    print(
        f"duplicates dropped: {dropped} (exact {d.get('exact')}, inexact {d.get('inexact')}, "
        f"max abs diff {d.get('max_abs_diff')})"
    )


def _print_attempts(m: dict) -> None:
    """A resumed run's attempts: the frames each saved, and how it ended (as the index records them)."""
    attempts = m.get("attempts")
    if not isinstance(attempts, list) or len(attempts) < 2 or not all(isinstance(a, dict) for a in attempts):
        return
    for a in attempts:
        failure = a.get("failure")
        ended = f"{failure.get('type')}" if isinstance(failure, dict) else "completed"
        if isinstance(failure, dict) and failure.get("rank") is not None:
            ended += f", rank {failure['rank']}"
        print(f"attempt {a.get('attempt')}: {a.get('frames')} frames saved ({ended})")


def _inspect_frames(ds: Any, name: str) -> int:
    """One filename: its frame indexes as runs, its segments, and each leaf's value statistics."""
    from ..core.flatten import flatten
    from ..core.ragged import Ragged
    from ..storage.views import column_label, frame_ranges

    if name not in ds:
        print(f"tdgather: {name!r} is not in {str(ds.path)!r} ({len(ds)} filenames)", file=sys.stderr)
        return 1
    frames = ds[name]
    count = frames.frame_idx.numel()
    print(f"{name!r}: {count} frames, {ds.layout(name).describe()}")
    print(f"frame_idx: {frame_ranges(frames.frame_idx)}")
    for s in ds.index["files"][name]["segments"]:
        print(f"  segment: {s['shard']} {s['group']} rows {s['start']}..{s['start'] + s['frames']}")
    layout, tensors, json_values = flatten(frames.frames, count, name)
    print(f"{'leaf':<20} {'dtype':<16} {'shape':<14} statistics")
    for leaf, t in zip(layout.leaves, tensors, strict=True):
        label = column_label(leaf.path)
        values = t.values[int(t.offsets[0]) : int(t.offsets[-1])] if isinstance(t, Ragged) else t
        print(f"{label:<20} {str(leaf.dtype).removeprefix('torch.'):<16} {leaf.dims():<14} {_stats(values)}")
        if isinstance(t, Ragged):
            n = t.lengths
            spread = f"min {int(n.min())}, mean {float(n.double().mean()):.1f}, max {int(n.max())}" if count else "-"
            print(f"{'':<20} {'':<16} {'':<14} rows per frame {spread}")
    for path, values in zip(layout.nontensor, json_values, strict=True):
        kinds = sorted({type(v).__name__ for v in values})
        distinct = {repr(v) for v in values}
        examples = ", ".join(sorted(distinct)[:3])
        label = column_label(path)
        print(f"{label:<20} {'json':<16} {'':<14} {len(distinct)} distinct ({'/'.join(kinds)}): {examples}")
    return 0


def _stats(t: Any) -> str:
    """Min / mean / max and NaN count of a tensor's values (of |x| for complex; true count for bool)."""
    import torch

    if t.numel() == 0:
        return "no values"
    if t.dtype == torch.bool:
        return f"true {int(t.sum())} of {t.numel()}"
    prefix = ""
    if t.is_complex():
        t, prefix = t.resolve_conj().abs(), "|x| "
    if t.is_floating_point():
        x = t.double()
        nan = torch.isnan(x)
        x = x[~nan]
        if x.numel() == 0:
            return f"{prefix}all NaN ({int(nan.sum())})"
        lo, mean, hi = float(x.min()), float(x.mean()), float(x.max())
        return f"{prefix}min {lo:.6g}, mean {mean:.6g}, max {hi:.6g}, NaN {int(nan.sum())}"
    a = t.numpy()  # integers, uint64 included: exact min and max
    return f"min {a.min()}, mean {float(a.mean(dtype='float64')):.6g}, max {a.max()}, NaN 0"


_PATH_HELP = "a dataset directory, or an object store URL (s3://bucket/prefix, ...)"


def _snapshots(args: argparse.Namespace) -> int:
    """One line per snapshot of a dataset that jobs append to, oldest first (snapshot 0: its first index)."""
    from ..format.names import INDEX_NAME
    from ..storage.snapshots import snapshots

    found = snapshots(args.path, args.storage_options)
    if not found:
        print(f"tdgather: {args.path!r} holds no snapshot and no {INDEX_NAME}: no dataset there", file=sys.stderr)
        return 1
    print(
        f"{'version':>7}  {'made (UTC)':<29}  {'run':<12}  {'frames':>9}  {'filenames':>9}  {'added':>9}  "
        f"{'duplicates dropped':>18}  job/host"
    )
    for s in found:
        who = "/".join(x for x in (s.job, s.host) if x) or "-"
        who = who if s.compacted is None else f"compaction of {s.compacted}: {who}"
        print(
            f"{s.version:>7}  {s.made or '-':<29}  {(s.run or '-')[:12]:<12}  {s.frames:>9}  {s.filenames:>9}  "
            f"{s.added:>9}  {s.duplicates_dropped:>18}  {who}"
        )
    newest = found[-1].version
    print(
        f"{len(found)} snapshot(s); tdgather.open reads the newest, {newest} "
        f"(tdgather.open(path, version=N): snapshot N as it was committed)"
    )
    return 0


def _compact(args: argparse.Namespace) -> int:
    """Rewrite the newest snapshot's frames into fewer shards, as the next snapshot."""
    from ..storage.compact import compact

    s = compact(args.path, args.storage_options, max_shard_bytes=args.max_shard_bytes)
    print(
        f"snapshot {s.version}: snapshot {s.compacted}'s {s.frames} frames of {s.filenames} filenames in new shards "
        "(nothing removed: tdgather expire PATH removes what only older snapshots list)"
    )
    return 0


def _expire(args: argparse.Namespace) -> int:
    """Remove snapshots superseded more than --older-than ago, and the shards only they list."""
    from ..storage.expire import expire

    got = expire(
        args.path, args.storage_options, older_than=args.older_than, orphans=args.orphans, dry_run=args.dry_run
    )
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(got.snapshots)} snapshot(s) {_ranges(got.snapshots)} and {len(got.shards)} shard(s), "
        f"{got.bytes:,} bytes; kept {len(got.kept)} snapshot(s) {_ranges(got.kept)}"
    )
    for name in got.shards:
        print(f"  {name}")
    return 0


def _ranges(numbers: tuple[int, ...]) -> str:
    """``(1, 2, 3, 7)`` as ``[1-3, 7]``."""
    out: list[list[int]] = []
    for n in numbers:
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out) + "]"


def _duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``6h`` or ``7d``: seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 15m, 6h or 7d, got {text!r}")
    return value


def _export_hf(args: argparse.Namespace) -> int:
    """Write a dataset as Hugging Face ``datasets``: ``save_to_disk`` (Arrow) or Parquet shards."""
    from ..storage.location import is_url, local_path
    from ..storage.reader import Dataset

    out = local_path(args.out)  # a file:// URL is the path it names
    if out.exists():
        print(f"tdgather: {str(out)!r} exists; choose a new directory (export-hf never replaces one)", file=sys.stderr)
        return 1
    if not is_url(args.path) and Path(os.path.realpath(out)).is_relative_to(os.path.realpath(local_path(args.path))):
        print(f"tdgather: {str(out)!r} is inside the dataset {args.path!r}; write it beside", file=sys.stderr)
        return 1
    ds = Dataset(args.path, storage_options=args.storage_options)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tdgather-hf-", dir=out.parent) as cache:  # beside OUT, not in ~
        hf = ds.to_hf(cache_dir=cache, filenames=args.filenames)  # integrations.hf: tools may not import it
        if args.parquet:
            written = _write_parquet(hf, out, args.shard_bytes)
            how = f"datasets.load_dataset('parquet', data_dir={str(out / 'data')!r})"
        else:
            hf.save_to_disk(str(out))
            written = sorted(p for p in out.rglob("*") if p.is_file())
            how = f"datasets.load_from_disk({str(out)!r})"
    files = len(set(args.filenames)) if args.filenames else len(ds)
    print(f"wrote {len(hf)} rows ({files} filenames) to {out}:")
    for p in written:
        print(f"  {p.relative_to(out)}  {_size(p.stat().st_size)}")
    print("columns:")
    for column, feature in hf.features.items():
        print(f"  {column}: {feature}")
    converted = json.loads(hf.info.description)["tdgather"]["converted"]
    for column, change in converted.items():
        print(f"  converted {column}: {change} (Arrow has no such type)")
    print(f"read it with {how}")
    return 0


def _write_parquet(hf: Any, out: Path, shard_bytes: int) -> list[Path]:
    """Parquet shards as the Hub lays them out: ``data/train-00000-of-0000N.parquet``."""
    shards = max(1, math.ceil(hf.data.nbytes / shard_bytes))
    (out / "data").mkdir(parents=True)
    paths = []
    for k in range(shards):
        path = out / "data" / f"train-{k:05d}-of-{shards:05d}.parquet"
        hf.shard(num_shards=shards, index=k, contiguous=True).to_parquet(str(path))
        paths.append(path)
    return paths


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
    inspect.add_argument("path", help=_PATH_HELP)
    inspect.add_argument("--limit", type=int, default=50, help="filenames to list (default 50)")
    inspect.add_argument("--all", action="store_true", help="list every filename")
    inspect.add_argument(
        "--incomplete",
        action="store_true",
        help="what a failed run saved (in PATH.partial; under a URL, beside the dataset)",
    )
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="read every shard whole against the checksum the index records (exit 1 where a shard has none)",
    )
    _storage_options(inspect)
    inspect.add_argument(
        "--frames", metavar="FILENAME", help="one filename: its frame indexes (as ranges) and per-leaf statistics"
    )
    inspect.set_defaults(run=_inspect)
    snaps = sub.add_parser(
        "snapshots", help="list the snapshots of a dataset that jobs append to (append=True), one line each"
    )
    snaps.add_argument("path", help=_PATH_HELP)
    _storage_options(snaps)
    snaps.set_defaults(run=_snapshots)
    comp = sub.add_parser(
        "compact", help="rewrite the newest snapshot's frames into fewer shards, committed as the next snapshot"
    )
    comp.add_argument("path", help=_PATH_HELP)
    comp.add_argument(
        "--max-shard-bytes", type=_positive, default=1 << 30, help="bytes per compacted shard, at most (default 1 GiB)"
    )
    _storage_options(comp)
    comp.set_defaults(run=_compact)
    exp = sub.add_parser(
        "expire", help="remove snapshots superseded more than --older-than ago, and the shards only they list"
    )
    exp.add_argument("path", help=_PATH_HELP)
    exp.add_argument(
        "--older-than",
        type=_duration,
        default=7 * 86400.0,
        metavar="DURATION",
        help="how long a superseded snapshot stays readable: 90s, 15m, 6h, 7d (default 7d)",
    )
    exp.add_argument(
        "--orphans", action="store_true", help="also remove shards no snapshot lists (only while no job appends)"
    )
    exp.add_argument("--dry-run", action="store_true", help="remove nothing; print what would go")
    _storage_options(exp)
    exp.set_defaults(run=_expire)
    export = sub.add_parser("export-hf", help="write a dataset as Hugging Face datasets (Arrow, or --parquet)")
    export.add_argument("path", help="the tdgather dataset")
    export.add_argument("out", help="a new directory to write")
    export.add_argument(
        "--parquet", action="store_true", help="Parquet shards in OUT/data (the format to share, e.g. on the Hub)"
    )
    export.add_argument(
        "--shard-bytes", type=_positive, default=500_000_000, help="Parquet bytes per shard (default 500 MB)"
    )
    export.add_argument(
        "--filenames", nargs="+", metavar="FILENAME", help="export only these (filenames whose layouts differ: apart)"
    )
    _storage_options(export)
    export.set_defaults(run=_export_hf)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `tdgather inspect ... | head`
        sys.stderr.close()
        return 0
    except (TdgatherError, OSError, ValueError) as e:
        print(f"tdgather: {e}", file=sys.stderr)
        return 1


def _storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options",
        type=_json_object,
        metavar="JSON",
        help='for a URL: fsspec options, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
