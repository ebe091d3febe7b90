"""The dtypes tdgather carries: those safetensors stores, bit-exactly."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "SAFETENSORS_CODE", "dtype_from_name", "dtype_name", "supported_list"]

# name on the wire -> (torch dtype, safetensors dtype code)
_TABLE: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    "complex64": (torch.complex64, "C64"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint64": (torch.uint64, "U64"),
    "uint32": (torch.uint32, "U32"),
    "uint16": (torch.uint16, "U16"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}

DTYPES: dict[str, torch.dtype] = {name: dt for name, (dt, _) in _TABLE.items()}
SAFETENSORS_CODE: dict[torch.dtype, str] = {dt: code for dt, code in _TABLE.values()}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def supported_list() -> str:
    """Return the supported dtype names, comma separated, for error messages."""
    return ", ".join(DTYPES)


def dtype_name(dtype: torch.dtype) -> str | None:
    """Return the wire name of ``dtype``, or None when it is not supported.

    >>> dtype_name(torch.bfloat16), dtype_name(torch.complex128)
    ('bfloat16', None)
    """
    return _NAMES.get(dtype)


def dtype_from_name(name: str) -> torch.dtype | None:
    """Return the torch dtype for a wire name, or None when it is unknown.

    >>> dtype_from_name("float8_e5m2")
    torch.float8_e5m2
    """
    return DTYPES.get(name)
