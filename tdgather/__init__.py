"""tdgather: gather per-rank frame predictions to one CPU process, without pickle, and save them."""

from .api.collector import Collector, CollectorStatus, CollectorSummary
from .api.gather import Gathered, GatherStats, gather
from .core.duplicates import DuplicateCounts, DuplicatePolicy
from .core.frames import Frames
from .core.framestore import FrameStore
from .core.ragged import padded
from .errors import (
    CallMismatchError,
    DatasetError,
    DuplicateFrameError,
    ExportError,
    FrameConflictError,
    OutputError,
    PeerError,
    PeerLostError,
    ProtocolError,
    ShapeMismatchError,
    StalledError,
    TdgatherError,
    Terminated,
    UnsupportedValueError,
)
from .integrations.hf import to_hf
from .storage.compact import compact
from .storage.expire import Expired, expire
from .storage.reader import Dataset
from .storage.reader import open_dataset as open
from .storage.resume import saved_at
from .storage.save import save
from .storage.saved import Saved
from .storage.sink import Sink, SinkFactory
from .storage.snapshots import Snapshot, snapshots
from .storage.views import collate_frames

# ``ds.to_hf(...)``: the Hugging Face export is an integration, which the storage layer (the reader) may not
# import; every Dataset is made after this package is imported, so each has the method
Dataset.to_hf = to_hf

__all__ = [
    "CallMismatchError",
    "Collector",
    "CollectorStatus",
    "CollectorSummary",
    "Dataset",
    "DatasetError",
    "DuplicateCounts",
    "DuplicateFrameError",
    "ExportError",
    "Expired",
    "DuplicatePolicy",
    "FrameConflictError",
    "FrameStore",
    "Frames",
    "GatherStats",
    "Gathered",
    "OutputError",
    "PeerError",
    "PeerLostError",
    "ProtocolError",
    "Saved",
    "ShapeMismatchError",
    "Sink",
    "SinkFactory",
    "Snapshot",
    "StalledError",
    "TdgatherError",
    "Terminated",
    "UnsupportedValueError",
    "collate_frames",
    "compact",
    "expire",
    "gather",
    "open",
    "padded",
    "save",
    "saved_at",
    "snapshots",
    "to_hf",
]

__version__ = "0.1.0"
