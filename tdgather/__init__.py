"""tdgather: gather per-rank frame predictions to one CPU process, without pickle, and save them."""

from .collector import Collector, CollectorSummary
from .duplicates import DuplicateCounts, DuplicatePolicy
from .errors import (
    CallMismatchError,
    DatasetError,
    DuplicateFrameError,
    FrameConflictError,
    OutputError,
    PeerError,
    PeerLostError,
    ProtocolError,
    ShapeMismatchError,
    TdgatherError,
    Terminated,
    UnsupportedValueError,
)
from .frames import Frames
from .gather import Gathered, GatherStats, gather
from .ragged import padded
from .reader import Dataset
from .reader import open_dataset as open
from .sink import save
from .store import FrameStore

__all__ = [
    "CallMismatchError",
    "Collector",
    "CollectorSummary",
    "Dataset",
    "DatasetError",
    "DuplicateCounts",
    "DuplicateFrameError",
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
    "TdgatherError",
    "Terminated",
    "UnsupportedValueError",
    "gather",
    "open",
    "padded",
    "save",
]

__version__ = "0.1.0"
