"""tdgather: gather per-rank frame predictions to one CPU process, without pickle, and save them."""

from .api.collector import Collector, CollectorStatus, CollectorSummary
from .api.gather import Gathered, GatherStats, gather
from .core.duplicates import DuplicateCounts, DuplicatePolicy
from .core.frames import Frames
from .core.ragged import padded
from .core.store import FrameStore
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
from .storage.reader import Dataset
from .storage.reader import open_dataset as open
from .storage.save import save

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
    "ShapeMismatchError",
    "StalledError",
    "TdgatherError",
    "Terminated",
    "UnsupportedValueError",
    "gather",
    "open",
    "padded",
    "save",
]

__version__ = "0.1.0"
