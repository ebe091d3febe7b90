"""Pure tests of the frame store and the wire codec: pack -> validate -> place."""

import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdgather
from tdgather.comm.pack import PIECE_MIN, pack
from tdgather.comm.wire import Kind, Limits, Prelude, decode_header, decode_index, decode_json, encode_json
from tdgather.core.dtypes import DTYPES
from tdgather.core.merge import merge
from tdgather.errors import ProtocolError, ShapeMismatchError, UnsupportedValueError

from .cases import bits, value, wire_roundtrip


def roundtrip(store: tdgather.FrameStore, rank: int = 0):
    parts, packed = wire_roundtrip(store, rank)
    return parts, packed.header, packed


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 2), (2, 3, 4)])
def test_every_dtype_and_shape_roundtrips_bit_exactly(dtype, shape):
    frames = {f"f{j % 2}": [(j, value(f"f{j % 2}", j, shape, dtype)) for j in (j, j + 2)] for j in range(2)}
    if dtype.is_floating_point and shape == (3,):  # NaN and -0.0 must survive as bits
        frames["nan"] = (0, torch.tensor([float("nan"), -0.0, float("inf")]).to(dtype))
    store = tdgather.FrameStore()
    store.update(frames)
    parts, _, _ = roundtrip(store)
    result = merge(parts)
    merged = result.files
    assert result.duplicates.dropped == 0
    for name, pairs in frames.items():
        pairs = [pairs] if isinstance(pairs, tuple) else pairs
        got = merged[name]
        assert got.frame_idx.tolist() == sorted(i for i, _ in pairs)
        for row, (_, v) in enumerate(sorted(pairs, key=lambda p: p[0])):
            assert got.frames[row].dtype == dtype and got.frames[row].shape == v.shape
            assert torch.equal(bits(got.frames[row]), bits(v))


def test_non_contiguous_and_batched_input():
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    store = tdgather.FrameStore()
    src = x[:, ::2]
    assert not src.is_contiguous()
    store.add(["a", "b", "a", "b"], torch.tensor([3, 1, 0, 0]), src)
    merged = merge(roundtrip(store)[0]).files
    assert merged["a"].frame_idx.tolist() == [0, 3]
    assert torch.equal(merged["a"].frames, src[[2, 0]])
    assert torch.equal(merged["b"].frames, src[[3, 1]])


def test_the_wire_carries_the_frame_bytes_and_a_small_index():
    store = tdgather.FrameStore()
    store.update({f"f{i}": [(j, torch.zeros(16)) for j in range(100)] for i in range(4)})
    packed = pack(store)
    assert sum(t.nbytes for piece in packed.pieces for t in piece) == 4 * 100 * 16 * 4  # no padding
    runs = 16 * len(store.names)  # (file id, rows) per run: the frames of a file are added together here
    assert packed.index.numel() <= 4 * 100 * 4 + runs + 2 * 64  # int32 frame_idx: every index fits


def test_large_batches_go_on_the_wire_as_they_are_and_small_ones_are_joined():
    store = tdgather.FrameStore(copy=False)
    big = torch.randn(64, PIECE_MIN // 4 // 32)  # 64 frames, 2 x PIECE_MIN bytes
    small = [torch.randn(4, big.shape[1]) for _ in range(3)]  # 4 frames: far under PIECE_MIN
    store.add(["a"] * 64, torch.arange(64), big)
    for k, t in enumerate(small):
        store.add(["b"] * 4, torch.arange(4 * k, 4 * k + 4), t)
    packed = pack(store)
    assert [len(p) for p in packed.pieces] == [1, 3]  # one batch sent as it is; three small ones joined
    assert packed.pieces[0][0].data_ptr() == big.data_ptr()  # no copy
    assert packed.header["groups"][0]["pieces"] == [[64, 12]]
    parts, _, _ = roundtrip(store)
    out = merge(parts).files
    assert torch.equal(out["a"].frames, big) and torch.equal(out["b"].frames, torch.cat(small))


def test_a_batch_larger_than_a_piece_is_cut_into_whole_rows():
    from tdgather.comm.pack import PIECE_MAX

    store = tdgather.FrameStore(copy=False)
    rows = torch.randn(5, PIECE_MAX // 4 // 2 + 1)  # a row just over half a piece: one row per piece
    store.add("a", torch.arange(5), rows)
    packed = pack(store)
    assert packed.header["groups"][0]["pieces"] == [[1, 1, 1, 1, 1]]
    assert torch.equal(merge(roundtrip(store)[0]).files["a"].frames, rows)


def test_large_frame_indices_travel_as_int64():
    store = tdgather.FrameStore()
    store.add("a", torch.tensor([2**40, 5]), torch.zeros(2, 1))
    parts, header, _ = roundtrip(store)
    assert header["groups"][0]["index"] == "int64"
    assert parts[0].frame_idx.tolist() == [2**40, 5]  # in the sender's order; rank dst sorts


def test_store_forms_and_counts():
    store = tdgather.FrameStore()
    store.update({"one.jpg": (7, torch.ones(2)), "many.mp4": [(1, torch.ones(2)), (0, torch.zeros(2))]})
    store.add("many.mp4", [2, 3], torch.full((2, 2), 5.0))
    assert len(store) == 5 and store.nbytes == 5 * 8
    merged = merge(roundtrip(store)[0]).files
    assert merged["many.mp4"].frame_idx.tolist() == [0, 1, 2, 3]
    assert merged["one.jpg"].frames.tolist() == [[1.0, 1.0]]


def test_store_rejects_bad_input_with_clear_messages():
    store = tdgather.FrameStore()
    with pytest.raises(
        UnsupportedValueError, match=r"filename 'x', frame_idx 0: expected a dense tensor.*got dtype torch.complex128"
    ):
        store.update({"x": (0, torch.zeros(2, dtype=torch.complex128))})
    with pytest.raises(UnsupportedValueError, match="got a nested tensor for one frame"):
        store.update({"x": (0, torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged))})
    with pytest.raises(UnsupportedValueError, match="sparse"):
        store.update({"x": (0, torch.zeros(2, 2).to_sparse())})
    with warnings.catch_warnings():  # quantized tensors are deprecated in recent torch
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedValueError, match="a quantized tensor"):
        store.update({"x": (0, quantized)})
    with pytest.raises(UnsupportedValueError, match="meta tensor"):
        store.update({"x": (0, torch.zeros(2, device="meta"))})
    with pytest.raises(UnsupportedValueError, match=r"key 'label'.*got set"):
        store.update({"x": (0, {"t": torch.zeros(1), "label": {1, 2}})})
    with pytest.raises(UnsupportedValueError, match=r"key 'score'.*got float nan"):
        store.update({"x": (0, {"t": torch.zeros(1), "score": float("nan")})})
    with pytest.raises(UnsupportedValueError, match=r"filename 'p': expected \(frame_idx, value\) or a list.*got int"):
        store.update({"p": [(0, torch.zeros(1)), 5]})
    with pytest.raises(UnsupportedValueError, match=r"filename 'p': expected \(frame_idx, value\).*got Tensor"):
        store.update({"p": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"got 3 filenames and 2 frame indices"):
        store.add(["a", "b", "c"], [0, 1], torch.zeros(2, 1))
    with pytest.raises(ValueError, match="leading batch dimension of 3"):
        store.add(["a", "b", "c"], [0, 1, 2], torch.zeros(2, 1))
    store.update({"s": (0, torch.zeros(3))})
    with pytest.raises(ShapeMismatchError, match=r"filename 's'.*float32\[3\] and float64\[3\]"):
        store.update({"s": (1, torch.zeros(3, dtype=torch.float64))})
    assert len(store) == 1  # nothing half-added


class Views:
    """Every view of a tensor a user may hand over, with what its frames must read back as."""

    @staticmethod
    def cases():
        base = torch.randn(4, 3, 2, 5)
        c = torch.randn(4, 3, dtype=torch.complex64)
        return {
            "non_contiguous": base[:, :, 0, ::2],
            "channels_last": base.contiguous(memory_format=torch.channels_last),
            "expanded": torch.arange(3.0).expand(4, 3),
            "conj": c.conj(),
            "neg": torch.conj(c).imag,  # a negative view
            "transposed": torch.randn(3, 4, 2).transpose(0, 1),
            "slice_of_large": torch.randn(4, 1000)[:, :2],
        }


@pytest.mark.parametrize("form", ["add", "update_pair", "update_list"])
@pytest.mark.parametrize("case", list(Views.cases()), ids=list(Views.cases()))
def test_every_view_is_sent_as_the_values_it_shows(form, case):
    t = Views.cases()[case]
    want = t.resolve_conj().resolve_neg().clone()
    store = tdgather.FrameStore()
    if form == "add":
        store.add(["v"] * 4, torch.arange(4), t)
    elif form == "update_pair":
        store.update({f"v{i}": (0, t[i]) for i in range(4)})
    else:
        store.update({"v": [(i, t[i]) for i in range(4)]})
    merged = merge(roundtrip(store)[0]).files
    got = merged["v"].frames if "v" in merged else torch.stack([merged[f"v{i}"].frames[0] for i in range(4)])
    assert torch.equal(got, want)


def test_frame_idx_accepts_every_integer_form_and_refuses_the_rest():
    import numpy as np

    store = tdgather.FrameStore()
    store.add(["a"] * 3, np.array([0, 1, 2], dtype=np.int32), torch.zeros(3, 1))
    store.add(("a", "a"), [np.int64(3), torch.tensor(4)], torch.zeros(2, 1))
    store.add(["a"], [torch.tensor([5])], torch.zeros(1, 1))
    store.add(["a"], [np.array([8])], torch.zeros(1, 1))  # a one-element array, as an index
    store.update(
        {"a": [(np.int16(6), torch.zeros(1)), (torch.tensor(7), torch.zeros(1))], "b": (np.uint8(0), torch.ones(1))}
    )
    store.add(["c", "c"], [np.uint64(5), np.uint64(2)], torch.zeros(2, 1))  # numpy uint64 scalars
    store.add(["d"], torch.tensor([3], dtype=torch.uint64), torch.zeros(1, 1))
    store.update({"e": (torch.tensor(4, dtype=torch.uint64), torch.ones(1))})
    merged = merge(roundtrip(store)[0]).files
    assert merged["a"].frame_idx.tolist() == list(range(9)) and merged["b"].frame_idx.tolist() == [0]
    assert merged["c"].frame_idx.tolist() == [2, 5] and merged["d"].frame_idx.tolist() == [3]
    assert merged["e"].frame_idx.tolist() == [4]
    for bad, shown in [
        (29.97, "float 29.97"),
        (3.0, "float 3.0"),
        (True, "bool True"),
        ("3", "str '3'"),
        (np.float64(1.0), "float64"),
        (torch.tensor(1.5), "Tensor"),
        (None, "NoneType"),
    ]:
        with pytest.raises(UnsupportedValueError, match=r"filename 'x'\): expected integers .*refused, not truncated"):
            store.update({"x": (bad, torch.zeros(1))})
        assert shown in str(pytest.raises(UnsupportedValueError, store.update, {"x": [(bad, torch.zeros(1))]}).value)
        with pytest.raises(UnsupportedValueError, match=r"add\(\) frame_idx \(position 0\): expected integers"):
            store.add(["x"], [bad], torch.zeros(1, 1))
    with pytest.raises(UnsupportedValueError, match=r"got a tensor of dtype torch.float32"):
        store.add(["x"], torch.tensor([1.0]), torch.zeros(1, 1))
    with pytest.raises(UnsupportedValueError, match=r"got a tensor of dtype torch.bool"):
        store.add(["x"], np.array([True]), torch.zeros(1, 1))
    with pytest.raises(
        UnsupportedValueError,
        match=r"position 0\): expected an index that fits in int64, got 2\*\*64|"
        r"fits in int64, got 18446744073709551616",
    ):
        store.add(["x"], [2**64], torch.zeros(1, 1))
    # uint64 past int64: refused in every form, never wrapped to a negative index
    for big in (np.array([2**63], dtype=np.uint64), torch.tensor([2**64 - 1], dtype=torch.uint64), [np.uint64(2**63)]):
        with pytest.raises(
            UnsupportedValueError, match=r"position 0\): expected an index that fits in int64, got (9|1)"
        ):
            store.add(["x"], big, torch.zeros(1, 1))
    with pytest.raises(UnsupportedValueError, match=r"filename 'x'\): expected an index that fits in int64, got 9"):
        store.update({"x": (torch.tensor(2**63, dtype=torch.uint64), torch.zeros(1))})
    with pytest.raises(ValueError, match=r"add\(\): got 3 filenames and 2 frame indices"):
        store.add(["x"] * 3, [1, 2], torch.zeros(2, 1))
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout: expected a positive, finite number of seconds"):
            tdgather.gather({}, timeout=bad)
    assert len(store) == 14  # nothing half-added


def test_empty_batches_of_any_shape_are_accepted():
    store = tdgather.FrameStore()
    store.add([], [], torch.zeros(0, 3, 7))
    store.add([], torch.zeros(0, dtype=torch.long), {"d": torch.zeros(0, 2), "s": []})
    store.update({"e": []})
    assert len(store) == 0 and store.num_chunks == 0


def test_filenames_that_utf8_cannot_encode_are_refused_where_given():
    import os

    name = os.fsdecode(b"clip_\xff.mp4")
    store = tdgather.FrameStore()
    with pytest.raises(UnsupportedValueError, match=r"cannot be encoded as UTF-8 .*os.fsdecode"):
        store.add([name], [0], torch.zeros(1, 1))
    with pytest.raises(UnsupportedValueError, match=r"expected str filenames, got int"):
        store.update({3: (0, torch.zeros(1))})
    assert len(store) == 0


def test_add_copies_by_default_so_reused_buffers_are_safe():
    out = torch.zeros(2, 3)
    safe, shared = tdgather.FrameStore(), tdgather.FrameStore(copy=False)
    for b in range(2):
        out.fill_(b)  # the loop reuses its output buffer
        safe.add([f"v{b}"] * 2, [0, 1], out)
        shared.add([f"v{b}"] * 2, [0, 1], out)
    assert merge(roundtrip(safe)[0]).files["v0"].frames.eq(0).all()
    assert merge(roundtrip(shared)[0]).files["v0"].frames.eq(1).all()  # the documented rule, broken on purpose


def test_a_view_of_a_large_storage_is_compacted_even_without_copy():
    big = torch.randn(8, 100_000)
    store = tdgather.FrameStore(copy=False)
    store.add(["a"] * 8, torch.arange(8), big[:, :2])
    held = store.groups()[0][1][0].tensors[0]
    assert held.untyped_storage().nbytes() == 8 * 2 * 4  # not the 3.2 MB it was cut from
    small = torch.randn(8, 2)
    store.add(["b"] * 8, torch.arange(8), small)
    assert store.groups()[0][1][1].tensors[0].data_ptr() == small.data_ptr()


def test_prelude_validation():
    good = Prelude(Kind.DATA, 0, 10, 100, 1)
    assert Prelude.decode(good.encode(), 1, 0, Limits()) == good
    cases = {
        "magic": (0, 0),
        "version": (1, 99),
        "kind": (2, 7),
        "seq": (3, 5),
        "header_len": (4, -1),
        "payload_len": (5, 1 << 50),
        "src": (6, 3),
    }
    for field, (i, v) in cases.items():
        t = good.encode()
        t[i] = v
        with pytest.raises(ProtocolError, match=rf"from rank 1 in prelude\.{field}: expected"):
            Prelude.decode(t, 1, 0, Limits(max_payload_bytes=1 << 40))
    done_with_payload = Prelude(Kind.DONE, 0, 10, 5, 1).encode()
    with pytest.raises(ProtocolError, match="0 for done or error"):
        Prelude.decode(done_with_payload, 1, 0, Limits())
    piece_with_header = Prelude(Kind.PIECE, 0, 10, 5, 1).encode()
    with pytest.raises(ProtocolError, match="prelude.header_len: expected 0 for a piece"):
        Prelude.decode(piece_with_header, 1, 0, Limits())


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"\xff\xfe", "invalid bytes"),
        (b'{"parts": NaN}', "NaN is not JSON"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b"[" * 100 + b"]" * 100, "nesting deeper"),
        (b"[" * 100000, "nesting deeper"),
    ],
)
def test_header_json_is_strict(raw, problem):
    with pytest.raises(ProtocolError, match=problem):
        decode_json(raw, 2, Limits())


def _valid_header():
    store = tdgather.FrameStore()
    store.update({"a": [(0, torch.zeros(2, 3)), (1, torch.ones(2, 3))], "b": (0, torch.ones(2, 3))})
    packed = pack(store)
    return json.loads(encode_json(packed.header)), packed.index


def test_header_schema_checks_rows_pieces_runs_and_sizes():
    header, index = _valid_header()
    n = index.numel()
    assert decode_header(header, Kind.DATA, 1, n).num_frames == 3

    def refused(change, match, payload_len=n):
        bad = json.loads(json.dumps(header))
        change(bad["groups"][0])
        with pytest.raises(ProtocolError, match=match):
            decode_header(bad, Kind.DATA, 1, payload_len)

    refused(lambda g: g["pieces"][0].append(1), r"pieces\[0\]: expected piece row counts >= 1 that sum to 3")
    refused(lambda g: g["pieces"].__setitem__(0, [1 << 40]), r"pieces\[0\]: expected piece row counts")
    refused(lambda g: g.__setitem__("rows", 0), r"rows: expected at least 1")
    refused(lambda g: g.__setitem__("runs", 4), r"runs: expected an integer in 0..3")
    refused(lambda g: g.__setitem__("index", "float32"), r"index: expected 'int32' or 'int64'")
    refused(lambda g: g["layout"]["leaves"][0].__setitem__("dtype", "complex128"), "a supported dtype name")
    refused(lambda g: g.__setitem__("extra", 1), r"header.groups\[0\]: expected an object with keys")
    refused(lambda g: g["json"].append([]), r"json: expected a list of 0 items")
    refused(
        lambda g: g.__setitem__(
            "layout",
            {
                "kind": "tree",
                "cls": None,
                "json": [["x", "y"]],
                "leaves": [{"path": ["x"], "dtype": "float32", "shape": [3]}],
            },
        ),
        r"layout.leaves: expected distinct non-empty paths, none inside another",
    )  # a hostile layout that rebuild() could not set: refused on receipt
    bad = json.loads(json.dumps(header))
    bad["files"] = ["a", "a"]
    with pytest.raises(ProtocolError, match="distinct filenames"):
        decode_header(bad, Kind.DATA, 1, n)
    with pytest.raises(
        ProtocolError, match=r"prelude.payload_len: expected \d+ \(the frame index the groups announce\)"
    ):
        decode_header(header, Kind.DATA, 1, n + 4096)  # bytes nothing announces are never allocated
    with pytest.raises(ProtocolError, match=r"prelude.payload_len: expected 0"):
        decode_header({"files": [], "groups": []}, Kind.DATA, 1, 1 << 30)  # a heartbeat with a 1 GiB payload
    max_piece = Limits(max_payload_bytes=40)  # a piece of 3 frames of 24 bytes is over it
    with pytest.raises(ProtocolError, match=r"pieces\[0\]: expected pieces of at most 40 bytes, got 72"):
        decode_header(header, Kind.DATA, 1, n, max_piece)


def test_frame_index_runs_are_checked_before_use():
    header, index = _valid_header()
    parsed = decode_header(header, Kind.DATA, 1, index.numel())
    ids, idx, lengths = decode_index(parsed, index, 1)[0]
    assert ids.tolist() == [0, 0, 1] and idx.tolist() == [0, 1, 0] and lengths == []
    runs_at = 64  # after the int32 frame_idx of 3 rows, aligned
    for field, wrong, match in [
        (0, 2, r"file ids in 0..1"),
        (1, 0, r"row counts >= 1 that sum to 3"),
        (1, 5, r"row counts >= 1 that sum to 3"),
    ]:
        bad = index.clone()
        bad[runs_at : runs_at + 16].view(torch.int64)[field] = wrong
        with pytest.raises(ProtocolError, match=rf"header.groups\[0\].runs\[\]: expected {match}"):
            decode_index(parsed, bad, 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_header_parser_never_crashes_on_random_bytes(raw):
    try:
        obj = decode_json(raw, 3, Limits())
        decode_header(obj, Kind.DATA, 3, 1024)
    except ProtocolError as e:
        assert e.rank == 3


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_header_parser_on_mutated_valid_headers(data):
    header, index = _valid_header()
    n = index.numel()
    path = []
    node = header
    while isinstance(node, dict | list) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append(key)
        node = node[key]
    if not path:
        return
    parent = header
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = data.draw(_json_values)
    try:
        parsed = decode_header(header, Kind.DATA, 2, n)
        decode_index(parsed, index, 2)  # whatever still validates must decode inside the payload
    except ProtocolError as e:
        assert e.rank == 2


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.text(min_size=0, max_size=30), min_size=1, max_size=6, unique=True),
    dtype=st.sampled_from(list(DTYPES.values())),
    shape=st.lists(st.integers(0, 3), max_size=3),
    counts=st.lists(st.integers(1, 4), min_size=6, max_size=6),
)
def test_roundtrip_property(names, dtype, shape, counts):
    frames = {
        n: [(j * 3, value(n, j, tuple(shape), dtype)) for j in range(c)] for n, c in zip(names, counts, strict=False)
    }
    store = tdgather.FrameStore()
    store.update(frames)
    merged = merge(roundtrip(store)[0]).files
    assert list(merged) == sorted(names)
    for n, pairs in frames.items():
        assert merged[n].frame_idx.tolist() == [i for i, _ in pairs]
        assert torch.equal(bits(merged[n].frames), bits(torch.stack([v for _, v in pairs])))
