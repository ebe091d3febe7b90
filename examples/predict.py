r"""An inference job under torchrun: every rank predicts its share, rank 0 writes one dataset.

One machine (4 processes):

    torchrun --standalone --nproc-per-node=4 examples/predict.py --out out/predict

Several machines: the same command on every node, with the same rendezvous id and endpoint
(a host:port reachable from every node); `--out` must be writable on the node that gets rank 0:

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-id=predict-42 \
             --rdzv-endpoint=node0.example.com:29400 examples/predict.py --out /data/predict

With a writer on every node (`--writer-per-node`), each node's first rank writes its node's frames
and rank 0 writes one index over all of them at the end; `--out` must then be one directory every
node sees (a shared filesystem).

On GPUs the default group is ``cpu:gloo,cuda:nccl`` and the model runs on the GPU; tdgather sends
on its own gloo group and nothing comes back to a GPU. Without GPUs it is plain gloo.

More ranks than GPUs on a node (4 ranks on a 1-GPU machine, to try a job out) is fine: the ranks
share the GPUs, local rank ``r`` on GPU ``r % torch.cuda.device_count()``, and the default group is
then plain gloo (NCCL takes one rank per GPU; this job needs no collective of its own).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.demo import DemoNet, assignment, video_frames


def main() -> None:
    """Parse the arguments, join the job, predict and collect."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/predict")
    p.add_argument("--videos", type=int, default=12)
    p.add_argument("--max-frames", type=int, default=40)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any single wait may take")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even where CUDA is available")
    p.add_argument("--writer-per-node", action="store_true", help="one writer per node (--out on a shared filesystem)")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun: the ranks on this node
    gpus = torch.cuda.device_count() if cuda else 0
    shared = cuda and local_world > gpus
    if cuda:
        # Ranks share the GPUs when there are more of them than GPUs (local rank r on GPU r % gpus):
        # torch.cuda.set_device(local_rank) alone fails with "invalid device ordinal" there.
        torch.cuda.set_device(local_rank % gpus)
    # NCCL takes one rank per GPU: with shared GPUs the default group is plain gloo (tdgather sends on
    # gloo either way, and nothing here needs a collective on the GPU)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda and not shared else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if shared and local_rank == 0:
        print(
            f"{local_world} ranks share {gpus} GPU(s) on this node: local rank r runs on cuda:(r % {gpus}); "
            "default group gloo (NCCL takes one rank per GPU)",
            flush=True,
        )

    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(max(1, args.max_frames // 5), args.max_frames + 1, (args.videos,), generator=g).tolist()
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = DemoNet().to(device).eval()
    mine = assignment(args.seed, lengths, world)[rank]  # uneven, shuffled; the last rank gets nothing

    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if args.writer_per_node else None  # set by torchrun
    col = tdgather.Collector(args.out, overwrite=True, timeout=args.timeout, ranks_per_writer=per_node)
    with col, torch.inference_mode():
        for i in range(0, len(mine), args.batch):
            batch = mine[i : i + args.batch]
            x = torch.cat([video_frames(args.seed, v, [t], args.size) for v, t in batch]).to(device)
            col.add([f"video_{v:04d}.mp4" for v, _ in batch], [t for _, t in batch], model(x))
    if col.summary is not None:
        print(col.summary, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
