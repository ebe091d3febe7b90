"""The benchmark suite runs and reports (figures are measured there, never asserted here)."""

from benchmarks.suite import main


def test_suite_smoke(tmp_path, capsys):
    args = [
        "--worlds",
        "2",
        "--workloads",
        "mixed",
        "--methods",
        "raw_p2p",
        "tdgather_store",
        "gather_object",
        "--scale",
        "0.01",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    [report] = tmp_path.glob("*.md")
    text = report.read_text()
    for method in ("raw_p2p", "tdgather_store", "gather_object"):
        assert f"| mixed | {method} |" in text
    assert "torch 2." in text and "command: `python -m benchmarks.suite" in text
    assert "failed" not in text


def test_scaling_smoke(tmp_path):
    from benchmarks.scaling import main as scaling

    assert scaling(["--worlds", "2", "3", "--mb", "0.2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*-scaling.md")
    text = report.read_text()
    for world in (2, 3):
        for method in ("raw_p2p", "tdgather_store", "gather_object"):
            assert f"| {world} | " in text and f" | {method} | " in text
    assert text.count("\n| ") == 1 + 2 * 3  # the header row, then one row per (world, method)


def test_detection_smoke(tmp_path):
    from benchmarks.detection import METHODS, _rank
    from tdgather.launch import run_local_world

    out = run_local_world(_rank, 2, 2, list(METHODS), 1, str(tmp_path), timeout=300)[0]
    rows = {m: (seconds, wire) for m, seconds, wire, _ in out["rows"]}
    assert sorted(rows) == sorted(METHODS)
    # bytes, not time: tdgather sends the frames plus its index and headers, no padding
    assert out["frame_bytes"] < rows["tdgather_gather"][1] < 1.1 * out["frame_bytes"]
    assert rows["pad_all_gather"][1] > rows["tdgather_gather"][1]
