"""`PredictionWriter`: a Lightning callback that streams ``trainer.predict`` outputs to a tdgather dataset.

Install with ``pip install tdgather[lightning]``. Every rank adds each batch's predictions to a
`tdgather.Collector` as soon as ``predict_step`` returns; rank 0 writes the dataset while the loop
runs, within the Collector's memory budget. Nothing is kept per rank, so pass
``return_predictions=False`` (the writer warns once, on rank 0, when it is on under several processes)::

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from tdgather.integrations.lightning import PredictionWriter

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 3)

        def predict_step(self, batch):
            return self.net(batch["x"])  # a tensor [B, ...], a dict of them, or a list of per-frame dicts

    samples = [{"filename": f"clip_{i // 4}.mp4", "frame_idx": i % 4, "x": torch.rand(8)} for i in range(10)]
    writer = PredictionWriter("out/preds", overwrite=True, timeout=600)  # any Collector keyword
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, callbacks=[writer], logger=False)
    trainer.predict(Model(), DataLoader(samples, batch_size=4), return_predictions=False)
    # rank 0: out/preds holds clip_0.mp4, clip_1.mp4, clip_2.mp4, every frame once: tdgather.open("out/preds")

Keys. Each frame is stored under ``(filename, frame_idx)``: by default a dict batch's
``"filename"`` and ``"frame_idx"`` fields (``filename_key=``, ``frame_idx_key=``), or what
``keys(batch, batch_indices, dataloader_idx) -> (filenames, frame_idx)`` returns. Without those
fields, the frame_idx is the sample's index in the dataset (Lightning's ``batch_indices``, which it
tracks for prediction writers) and the filename is ``"dataloader_<k>"``, so any ``predict`` can be
written. Lightning's predict sampler (``UnrepeatedDistributedSamplerWrapper``) gives each sample to
one rank only, so the dataset equals a single process's.

Several dataloaders. A Collector is a collective call, and only one may be open per process group,
so the writer opens one per dataloader, in order: dataloader 0's at ``on_predict_epoch_start``; on
the first batch of dataloader ``k`` it closes the open one and opens each up to ``k`` (closing the
ones skipped: a rank may get no batch of a small dataloader); at ``on_predict_epoch_end`` it closes
the open one and opens and closes the rest. So every rank opens and closes the same Collectors in
the same order, whatever batches it gets; a rank that gets no batch at all (Lightning then skips
its loop and every predict hook) does the whole sequence in ``teardown``. ``path`` is formatted
with ``{dataloader_idx}`` ("out/preds_{dataloader_idx}"); with one dataloader it may be a plain path.

Failures. On an exception (``on_exception``) the open Collector is aborted: every rank raises (the
failing rank its own error, the others `tdgather.PeerError`), and what reached rank 0 is kept in
``<path>.partial/`` (``tdgather.open(path, incomplete=True)``). Launchers end every process once
one exits with an error (Lightning's ``ddp`` launcher within 5 s, torchrun at once), so rank 0
answers a rank that failed only once it has listed what it saved: the failing rank's abort returns
after that. Under ``ddp_spawn`` Lightning calls no ``on_exception`` in its workers, and torch's
spawn ends the others at once: there a failure may leave ``.partial`` unlisted.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_warn

from ..api.collector import Collector, CollectorSummary
from ..core.duplicates import overlap_warning

__all__ = ["KeysFn", "PredictionWriter"]

log = logging.getLogger("tdgather")

KeysFn = Callable[[Any, Sequence[int], int], tuple[Any, Any]]
"""``keys(batch, batch_indices, dataloader_idx) -> (filenames, frame_idx)`` for one batch."""

PLACEHOLDER = "{dataloader_idx}"


class PredictionWriter(BasePredictionWriter):
    """Stream every rank's ``predict_step`` outputs to rank 0, which writes one tdgather dataset per dataloader.

    Args:
        path: the dataset directory; with several predict dataloaders a template with ``{dataloader_idx}``.
        keys: ``keys(batch, batch_indices, dataloader_idx) -> (filenames, frame_idx)``; picklable for ``ddp_spawn``.
        filename_key: the dict batch field holding the filenames (used when ``keys`` is None).
        frame_idx_key: the dict batch field holding the frame indexes.
        ragged: leaves ragged from their first frame, passed to every `Collector.add` (a leaf whose first
            dim changes is made ragged without it); False declares every leaf fixed (``Collector(ragged=False)``).
        **collector_kwargs: any `tdgather.Collector` keyword (``timeout``, ``duplicates``, ``overwrite``,
            ``memory_budget``, ``metadata``...). ``progress`` defaults to off when Lightning shows a progress bar.

    Attributes:
        summaries: on rank 0, each closed dataloader's `CollectorSummary`, by dataloader index.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        keys: KeysFn | None = None,
        filename_key: str = "filename",
        frame_idx_key: str = "frame_idx",
        ragged: Any = (),
        **collector_kwargs: Any,
    ) -> None:
        super().__init__(write_interval="batch")
        inspect.signature(Collector).bind(path, **collector_kwargs)  # a wrong keyword fails here, not on each rank
        self.path, self.keys, self.ragged = os.fspath(path), keys, ragged
        self.filename_key, self.frame_idx_key = filename_key, frame_idx_key
        self.collector_kwargs = collector_kwargs
        self.summaries: dict[int, CollectorSummary] = {}
        self._reset(started=False)

    def _reset(self, *, started: bool) -> None:
        self._col: Collector | None = None
        self._idx, self._next, self._count = -1, 0, 0
        self._started = started

    def path_for(self, dataloader_idx: int) -> str:
        """The dataset path of one dataloader."""
        return self.path.replace(PLACEHOLDER, str(dataloader_idx))

    # -- Lightning hooks ------------------------------------------------------------------------

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        """Warn (rank 0) when Lightning would also keep every prediction on every rank."""
        if trainer.world_size > 1 and trainer.predict_loop.return_predictions:
            rank_zero_warn(
                "PredictionWriter: return_predictions is on, so Lightning keeps every prediction in memory on "
                "every rank as well; pass trainer.predict(..., return_predictions=False)"
            )

    def on_predict_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the path for the dataloaders, then open dataloader 0's Collector."""
        self._start(trainer, trainer.predict_loop.num_dataloaders)
        self._advance(trainer, 0)

    def on_predict_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Make this batch's dataloader's Collector the open one (before ``predict_step`` runs)."""
        self._advance(trainer, dataloader_idx)

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Add the batch's predictions, under their keys, to the open Collector."""
        if prediction is None:
            return
        self._advance(trainer, dataloader_idx)
        filenames, frame_idx = self.batch_keys(batch, batch_indices, dataloader_idx)
        assert self._col is not None
        self._col.add(filenames, frame_idx, prediction, ragged=self.ragged)

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the open Collector, then open and close those of the dataloaders this rank got no batch of."""
        super().on_predict_epoch_end(trainer, pl_module)
        self._advance(trainer, self._count)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Abort the open Collector: every rank raises; rank 0 keeps what reached it in ``<path>.partial``."""
        col = self._col
        self._reset(started=self._started)
        self._count = -1  # nothing more to open in this run
        if col is not None:
            col.abort(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """On a rank that got no batch at all (its loop skipped every hook), take part in every Collector."""
        loop = trainer.predict_loop
        if stage != "predict" or self._started or getattr(loop, "_combined_loader", None) is None or not loop.skip:
            return
        self._start(trainer, loop.num_dataloaders)
        self._advance(trainer, self._count)

    # -- keys and Collectors -----------------------------------------------------------------------

    def batch_keys(self, batch: Any, batch_indices: Sequence[int] | None, dataloader_idx: int) -> tuple[Any, Any]:
        """The ``(filenames, frame_idx)`` of a batch: from ``keys``, from the batch's fields, or the fallback.

        Raises:
            ValueError: a batch with only one of the two fields, or no field and no batch indices.
        """
        if self.keys is not None:
            return self.keys(batch, batch_indices, dataloader_idx)
        have = [isinstance(batch, Mapping) and k in batch for k in (self.filename_key, self.frame_idx_key)]
        if all(have):
            frame_idx = batch[self.frame_idx_key]
            return batch[self.filename_key], frame_idx.cpu() if isinstance(frame_idx, torch.Tensor) else frame_idx
        if any(have):
            raise ValueError(
                f"PredictionWriter: the batch has only one of the fields {self.filename_key!r} and "
                f"{self.frame_idx_key!r}; give it both, name them (filename_key=, frame_idx_key=) or pass keys="
            )
        if not batch_indices:
            raise ValueError(
                "PredictionWriter: no batch indices from Lightning (the predict data is not a DataLoader) and no "
                f"{self.filename_key!r}/{self.frame_idx_key!r} fields in the batch; pass keys="
            )
        return f"dataloader_{dataloader_idx}", torch.as_tensor(list(batch_indices), dtype=torch.int64)

    def _start(self, trainer: Any, count: int) -> None:
        """Begin a predict epoch over ``count`` dataloaders, checking that each gets its own path."""
        if count > 1 and PLACEHOLDER not in self.path:
            raise ValueError(
                f"PredictionWriter: {count} predict dataloaders need a path template with {PLACEHOLDER}, "
                f"for example {self.path + '_' + PLACEHOLDER!r}; got {self.path!r}"
            )
        self._reset(started=True)
        self._count = count
        self.summaries = {}
        self._progress = False if trainer.progress_bar_callback is not None else None

    def _advance(self, trainer: Any, dataloader_idx: int) -> None:
        """Close and open Collectors, in dataloader order, until ``dataloader_idx``'s is open (or all are closed)."""
        while self._idx != dataloader_idx and self._next <= min(dataloader_idx, self._count):
            self._close()
            if self._next < self._count:
                self._open(self._next)
            self._next += 1

    def _open(self, dataloader_idx: int) -> None:
        kwargs = {"progress": self._progress, **self.collector_kwargs}
        if self.ragged is False:
            kwargs["ragged"] = False
        self._col = Collector(self.path_for(dataloader_idx), **kwargs).open()
        self._idx = dataloader_idx

    def _close(self) -> None:
        col, idx, self._col, self._idx = self._col, self._idx, None, -1
        if col is not None:
            summary = col.close()
            if summary is not None:
                self.summaries[idx] = summary
                self._check_copies(summary)

    def _check_copies(self, summary: Any) -> None:
        """Lightning's predict sampler never pads: a copy dropped means a frame never predicted; say so loudly.

        Not with ``resume=True``, whose frames sent again (saved by an earlier attempt) are dropped as copies.
        """
        if summary.warnings or self.collector_kwargs.get("resume"):  # the Collector has said it already
            return
        ranks = len(summary.frames_per_rank)
        warning = overlap_warning(summary.duplicates_dropped, ranks, 0, padding=False)
        if warning is not None:
            log.warning("tdgather: %s", warning)
            rank_zero_warn(f"tdgather: {warning}")
