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
    assert "torch 2." in text and "command: `tdgather bench" in text
    assert "failed" not in text
