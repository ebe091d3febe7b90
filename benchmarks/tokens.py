"""Variable-length 1-D outputs (a captioner's tokens): one layout group per length, or one ragged leaf.

Run: ``python -m benchmarks.tokens --prompts 8000 --world 2 --repeats 3``

Every rank holds its share of ``--prompts`` prompts (round-robin) as ``{prompt: (0, tokens)}``,
tokens int64 ``[N_i]`` with N_i in 1..500. Timed on rank 0, each call after a barrier: `gather`
then `save` (fsynced) of the same dict, as a plain dict (each distinct length is its own layout
group, as before ragged leaves) and with ``ragged=True`` (one group, values + offsets). The
ratio is of the two in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world


def _rank(prompts: int, repeats: int, out: str) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 501, (prompts,), generator=g).tolist()
    mine = {f"prompt_{p:05d}": (0, torch.randint(0, 50_000, (lengths[p],), generator=g)) for p in range(prompts)}
    mine = {name: v for p, (name, v) in enumerate(mine.items()) if p % world == rank}
    times: dict[str, list[float]] = {"per_length_groups": [], "ragged": []}
    groups = {}
    for _ in range(repeats):
        for how, ragged in (("per_length_groups", ()), ("ragged", True)):
            dist.barrier()
            t0 = time.perf_counter()
            result = tdgather.gather(mine, ragged=ragged, timeout=600)
            if result is not None:
                tdgather.save(result, f"{out}/{how}", overwrite=True)
                times[how].append(time.perf_counter() - t0)
                groups[how] = len(tdgather.open(f"{out}/{how}").index["shards"]["shard-00000.safetensors"]["groups"])
    if rank != 0:
        return None
    return {how: (statistics.median(t), groups[how]) for how, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="tdgather-tokens-")
    try:
        r = run_local_world(_rank, args.world, args.prompts, args.repeats, out, timeout=1800)[0]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    for how, (seconds, groups) in r.items():
        print(f"{how:<18} gather + save {seconds:.3f} s (median of {args.repeats}), {groups} layout groups")
    ratio = r["per_length_groups"][0] / r["ragged"][0]
    print(f"ragged is {ratio:.1f}x faster ({args.prompts} prompts, {args.world} ranks)")


if __name__ == "__main__":
    main()
