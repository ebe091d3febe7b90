"""Lightning runs for tests/test_lightning.py, each a script run: ``python tests/lightning_cases.py CASE OUT DEVICES``.

Lightning's ``ddp`` launcher re-executes ``sys.argv``, so every Trainer runs here, never inside pytest.
The model is elementwise (``tanh(x * w + b)``): a sample's prediction has the same bits whatever batch
or rank it runs in, so a 2-process dataset must equal the 1-process one bit for bit.

Cases:
    ``many``: strategy ``ddp`` (or one device), three predict dataloaders, path ``OUT/preds_{dataloader_idx}``:
        9 samples with ``filename``/``frame_idx`` fields; 3 such samples (1 on rank 1);
        7 samples without fields (fallback keys: ``dataloader_2``, the sample indexes).
    ``spawn``: strategy ``ddp_spawn``, those 7 samples, ``keys=`` a function, plain path ``OUT/preds``.
    ``fail``: strategy ``ddp``, 12 samples, rank 1 raises in its second ``predict_step``; ``return_predictions=True``.
    ``shuffled``: strategy ``ddp``, 23 one-frame samples, ``shuffle=True`` and no common seed (each rank seeds
        its own): the ranks' shares overlap, so some frames are predicted twice and others never.

Every rank writes ``OUT/rank<r>.json``: ``{"rank", "error", "message"}`` (``error`` null when it returned).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from tdgather.integrations.lightning import PredictionWriter

FEATURES = 6


class Elementwise(L.LightningModule):
    """``tanh(x * w + b)``, elementwise; raises in ``predict_step`` on rank ``fail_rank`` at batch ``fail_batch``."""

    def __init__(self, fail_rank: int = -1, fail_batch: int = 1, ready: Path | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(FEATURES, generator=g))
        self.b = torch.nn.Parameter(torch.randn(FEATURES, generator=g))
        self.fail_rank, self.fail_batch = fail_rank, fail_batch
        self.ready = ready  # with a failing rank: rank 0 marks here that its first batch was added

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        if self.ready is not None and self.global_rank == 0 and batch_idx == 1:
            self.ready.touch()  # batch 0's outputs went to the writer in its batch-end hook
        if self.global_rank == self.fail_rank and batch_idx == self.fail_batch:
            deadline = time.monotonic() + 30  # fail once rank 0 has added something: what the test checks is kept
            while self.ready is not None and not self.ready.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError(f"boom on rank {self.global_rank}")
        x = batch["x"] if isinstance(batch, dict) else batch
        y = torch.tanh(x * self.w + self.b)
        return {"y": y, "mean": y.mean(dim=1)} if isinstance(batch, dict) else y


def samples(n: int, *, fields: bool, seed: int) -> list:
    """``n`` samples: dicts with ``filename`` (3 frames per clip), ``frame_idx`` and ``x``, or bare tensors."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, FEATURES, generator=g)
    if not fields:
        return list(xs)
    return [{"filename": f"clip_{seed}_{i // 3}.mp4", "frame_idx": i % 3, "x": xs[i]} for i in range(n)]


def spawn_keys(batch, batch_indices, dataloader_idx):
    """The ``keys=`` of the spawn case (top level, so ``ddp_spawn`` can pickle the writer)."""
    return "spawned", torch.as_tensor(list(batch_indices))


def loaders(case: str) -> list[DataLoader]:
    if case in ("many", "writers", "memory"):
        sets = [samples(9, fields=True, seed=1), samples(3, fields=True, seed=2), samples(7, fields=False, seed=3)]
    elif case == "spawn":
        sets = [samples(7, fields=False, seed=3)]
    elif case == "shuffled":
        xs = samples(23, fields=False, seed=5)
        images = [{"filename": f"img_{i:02d}.jpg", "frame_idx": 0, "x": x} for i, x in enumerate(xs)]
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))  # no seed_everything: each rank its own
        return [DataLoader(images, batch_size=4, shuffle=True)]
    else:
        sets = [samples(12, fields=True, seed=4)]
    return [DataLoader(s, batch_size=2) for s in sets]


def run(case: str, out: Path, devices: int) -> None:
    if case == "many":
        writer = PredictionWriter(out / "preds_{dataloader_idx}", timeout=60)
    elif case == "writers":  # each of the 2 ranks its own writer: one dataset per dataloader all the same
        writer = PredictionWriter(out / "preds_{dataloader_idx}", timeout=60, ranks_per_writer=1)
    elif case == "spawn":
        writer = PredictionWriter(out / "preds", keys=spawn_keys, timeout=60)
    elif case == "memory":  # an object store URL, with storage_options passed through to each Collector
        writer = PredictionWriter(f"memory://{out.name}/preds_{{dataloader_idx}}", timeout=60, storage_options={})
    else:
        writer = PredictionWriter(out / "preds", timeout=60)
    strategy = "ddp_spawn" if case == "spawn" and devices > 1 else ("ddp" if devices > 1 else "auto")
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[writer],
    )
    model = Elementwise(fail_rank=1 if case == "fail" else -1, ready=out / "rank0-added" if case == "fail" else None)
    error = None
    try:
        trainer.predict(model, loaders(case), return_predictions=case == "fail")
    except Exception as e:
        error = e
        traceback.print_exc()
    rank = trainer.global_rank
    record = {"rank": rank, "error": type(error).__name__ if error else None, "message": str(error or "")}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if case == "fail" and rank != 0:
        # Lightning's ddp launcher SIGKILLs rank 0 once another rank exits with an error: let rank 0 write this
        # test's record first (tdgather's own list of what it saved is written before rank 1's abort returns)
        deadline = time.monotonic() + 30
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    if case == "spawn" and devices > 1:
        return  # ddp_spawn: this is the launching process; the workers wrote their records
    if error is not None:
        sys.exit(1)


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
