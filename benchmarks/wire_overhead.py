"""Bytes on the wire against the frame bytes, for every workload (no network: it packs each rank).

Run: ``python -m benchmarks.wire_overhead`` (world sizes 2 and 4).

Wire bytes per sender = preludes + JSON headers + the frame index (the data message's payload:
frame_idx, (file id, rows) runs and each ragged leaf's N_i) + the pieces. Pieces carry the frame
bytes exactly (of a ragged leaf: its rows, no padding), so the only padding is the alignment
inside the frame index. ``wire / frame`` is the ratio of the two (detection's target: <= 1.10).
"""

from __future__ import annotations

import argparse

from tdgather import FrameStore
from tdgather.comm.pack import pack
from tdgather.comm.wire import PRELUDE_LEN, encode_json

from .workloads import WORKLOADS, batches, describe


def measure(name: str, world: int) -> dict:
    frame_bytes = index_bytes = payload_bytes = header_bytes = preludes = 0
    for rank in range(world):
        store = FrameStore()
        for names, idx, frames in batches(name, rank, world):
            store.add(names, idx, frames)
        frame_bytes += store.nbytes
        preludes += 8 * PRELUDE_LEN  # the done message's prelude
        header_bytes += len(encode_json({"frames": len(store)}))
        if not len(store):
            continue
        packed = pack(store)
        preludes += 8 * PRELUDE_LEN * (1 + len(packed.pieces))
        header_bytes += len(encode_json(packed.header))
        payload_bytes += packed.index.numel() + sum(t.nbytes for piece in packed.pieces for t in piece)
        index_bytes += sum(
            g["rows"] * (4 if g["index"] == "int32" else 8) + 16 * g["runs"] + 8 * g["rows"] * _ragged_leaves(g)
            for g in packed.header["groups"]
        )
    padding = payload_bytes - frame_bytes - index_bytes
    wire = preludes + header_bytes + payload_bytes
    return {
        "workload": name,
        "world": world,
        "frame_MB": frame_bytes / 1e6,
        "wire_MB": wire / 1e6,
        "padding_pct": 100 * padding / frame_bytes,
        "index_pct": 100 * index_bytes / frame_bytes,
        "header_pct": 100 * (header_bytes + preludes) / frame_bytes,
        "overhead_pct": 100 * (wire - frame_bytes) / frame_bytes,
        "ratio": wire / frame_bytes,
    }


def _ragged_leaves(group: dict) -> int:
    """A data header group's ragged leaves: each sends its N_i, int64 per frame, in the frame index."""
    return sum(bool(leaf.get("ragged")) for leaf in group["layout"]["leaves"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = parser.parse_args()
    print("| workload | world | frame MB | wire MB | padding % | index % | headers % | overhead % | wire / frame |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads:
        for world in args.worlds:
            r = measure(name, world)
            print(
                f"| {name} ({describe(name)}) | {world} | {r['frame_MB']:.1f} | {r['wire_MB']:.1f} | "
                f"{r['padding_pct']:.3f} | {r['index_pct']:.2f} | {r['header_pct']:.3f} | {r['overhead_pct']:.2f} | "
                f"{r['ratio']:.3f} |"
            )


if __name__ == "__main__":
    main()
