r"""Hugging Face accelerate inference: every process predicts its share, rank 0 writes one dataset.

The loop is accelerate's usual one (``Accelerator()``, a DataLoader given to ``accelerator.prepare``,
``model.eval()`` and ``torch.inference_mode()``), with a `tdgather.Collector` where
``accelerator.gather_for_metrics`` would be: each batch's outputs go to ``col.add`` with the
samples' ``filename`` and ``frame_idx``, stream point-to-point to rank 0 behind the loop, and are
written there as a safetensors dataset. No pickle, no padding on the wire, and rank 0 holds at most
its memory budget, not the whole epoch.

A prepared DataLoader has ``even_batches=True``: when the samples do not fill the same number of
full batches on every process, the last batches are topped up with the first samples again. These
repeats carry the same ``(filename, frame_idx)`` as the originals, so tdgather's duplicates policy
(default ``"keep"``) keeps one copy, the lowest rank's, and counts the others in the summary and in
the index metadata (``duplicates_dropped``). ``gather_for_metrics`` drops them by position instead;
here nothing needs to know the dataset's length.

``--split`` shows the other accelerate pattern: a plain list of inputs shared with
``accelerator.split_between_processes`` (no padding: the shares may be uneven, tdgather does not
mind).

One machine, CPU only (2 processes, gloo). ``accelerate launch --cpu`` runs a single process, so
name the multi-process launcher and turn off what a CPU machine lacks:

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no examples/accelerate_predict.py --out out/accelerate

One GPU node (8 processes; NCCL for accelerate, tdgather makes its own gloo group):

    accelerate launch --num_processes 8 examples/accelerate_predict.py --out out/accelerate

More processes than GPUs (4 on a 1-GPU machine, to try a job out): accelerate itself puts local
process ``i`` on GPU ``i % torch.cuda.device_count()`` (it never asks for a GPU that is not there),
so the processes share the GPUs; the script says so. This loop runs no collective on the GPU (NCCL
takes one process per GPU: code added to the loop that does needs one GPU per process).

torchrun works too (``torchrun --standalone --nproc-per-node 2 examples/accelerate_predict.py
--out out/accelerate --cpu``), and so does plain ``python examples/accelerate_predict.py --out ...``
(one process: the same frames, bit for bit where a sample ran in the same batch).

Without CUDA, accelerate 1.x must be told ``Accelerator(cpu=True)``: otherwise it starts a process
group but reports a single process, its DataLoader does not shard, and every process runs every
batch. The script passes it when CUDA is missing and refuses to run if the counts disagree.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tdgather


class VideoFrames(Dataset):
    """(video, frame) pairs: ``lengths[v]`` frames of video ``v``, each a deterministic image."""

    def __init__(self, lengths: list[int], size: int, seed: int) -> None:
        self.pairs = [(v, t) for v, n in enumerate(lengths) for t in range(n)]
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        v, t = self.pairs[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 1000 * v + t)
        image = torch.rand(3, self.size, self.size, generator=g)  # frame t of video v, decoded
        return {"filename": f"video_{v:04d}.mp4", "frame_idx": t, "image": image}


class TinyNet(nn.Module):
    """Two outputs per frame: a depth map and class logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.depth = nn.Conv2d(8, 1, 1)
        self.classify = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``x``: images ``[B, 3, H, W]``; returns ``depth`` ``[B, 1, H, W]`` and ``logits`` ``[B, 10]``."""
        h = self.body(x)
        return {"depth": self.depth(h), "logits": self.classify(h.mean(dim=(2, 3)))}


def main() -> None:
    """Parse the arguments, predict with accelerate, collect on rank 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="dataset directory, written by rank 0 (replaced if it is one)")
    p.add_argument("--videos", type=int, default=3)
    p.add_argument("--frames", type=int, default=7, help="frames per video (3 x 7 = 21 samples: odd on purpose)")
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="batch size per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", action="store_true", help="split a list with split_between_processes, no DataLoader")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even where CUDA is available")
    args = p.parse_args()

    # Without CUDA, accelerate 1.x needs cpu=True to see the processes: otherwise it still starts a process
    # group but reports one process, and every process would run every batch.
    accelerator = Accelerator(cpu=args.cpu or not torch.cuda.is_available())
    world = dist.get_world_size() if dist.is_initialized() else 1
    if accelerator.num_processes != world:
        raise RuntimeError(f"accelerate sees {accelerator.num_processes} process(es) in a world of {world}: pass --cpu")
    if accelerator.device.type == "cuda" and accelerator.local_process_index >= torch.cuda.device_count():
        # accelerate placed local process i on GPU i % device_count: this one shares its GPU
        gpus = torch.cuda.device_count()
        print(
            f"local process {accelerator.local_process_index} shares {accelerator.device} ({gpus} GPU(s))", flush=True
        )
    data = VideoFrames([args.frames] * args.videos, args.size, args.seed)
    torch.manual_seed(args.seed)  # the same weights on every process
    model = accelerator.prepare_model(TinyNet(), evaluation_mode=True)  # on its device, no DDP wrapper
    model.eval()

    with tdgather.Collector(args.out, overwrite=True) as col, torch.inference_mode():
        if args.split:
            # A plain list of inputs: each process takes a contiguous share (uneven shares are fine,
            # so no apply_padding and no duplicates) and batches it by hand.
            with accelerator.split_between_processes(list(range(len(data)))) as mine:
                for i in range(0, len(mine), args.batch):
                    samples = [data[j] for j in mine[i : i + args.batch]]
                    x = torch.stack([s["image"] for s in samples]).to(accelerator.device)
                    col.add([s["filename"] for s in samples], [s["frame_idx"] for s in samples], model(x))
        else:
            # The prepared DataLoader shards the batches over the processes and, with even_batches,
            # tops the last ones up with repeats of the first samples: "keep" drops those on rank 0.
            loader = accelerator.prepare(DataLoader(data, batch_size=args.batch))
            for batch in loader:
                outputs = model(batch["image"])  # already on accelerator.device
                col.add(batch["filename"], batch["frame_idx"], outputs)  # instead of gather_for_metrics
    # every process has flushed; rank 0 has written and closed the dataset
    if col.summary is not None:  # rank 0 only
        print(col.summary, flush=True)
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
