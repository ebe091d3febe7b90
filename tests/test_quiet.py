"""Importing tdgather and building jagged tensors prints nothing but what the user asked for."""

import subprocess
import sys

SCRIPT = """
import torch
import tdgather
nt = torch.nested.nested_tensor_from_jagged(torch.arange(3.0), torch.tensor([0, 2, 3]))  # a detector's own code
store = tdgather.FrameStore()
store.add(["a.mp4", "a.mp4"], [0, 1], {"boxes": nt})
frames = tdgather.gather(store)["a.mp4"].frames  # a jagged tensor built by tdgather
print("lengths", frames["boxes"].offsets().diff().tolist())
"""


def test_no_torch_fx_notice_on_stderr():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lengths [2, 1]"
    assert "is_fx_tracing" not in out.stderr, out.stderr
    assert "UserWarning" not in out.stderr, out.stderr


def test_other_torch_fx_warnings_still_show():
    code = "import logging, tdgather; logging.getLogger('torch.fx._symbolic_trace').warning('another note')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "another note" in out.stderr


LOGGED = """
import logging, sys
import torch
import tdgather
setup = sys.argv[1]
if setup == "before":
    logging.basicConfig(level=logging.INFO, format="ROOT %(message)s")
with tdgather.Collector(sys.argv[2], progress=None if setup != "off" else False) as col:  # no process group
    if setup == "after":
        logging.basicConfig(level=logging.INFO, format="ROOT %(message)s")
    col.add(["a.mp4"] * 2, [0, 1], torch.ones(2, 3))
"""


def test_a_plain_log_shows_the_summary_once_with_no_logging_setup_and_nothing_with_progress_off(tmp_path):
    seen = {}
    for setup in ("none", "before", "after", "off"):
        out = subprocess.run(
            [sys.executable, "-c", LOGGED, setup, str(tmp_path / setup)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        seen[setup] = [line for line in out.stderr.splitlines() if "tdgather: 2 frames" in line]
    assert len(seen["none"]) == 1 and not seen["none"][0].startswith("ROOT")  # tdgather's own handler
    assert len(seen["before"]) == 1 and seen["before"][0].startswith("ROOT")  # the program's setup
    assert len(seen["after"]) == 1 and seen["after"][0].startswith("ROOT")  # not twice
    assert seen["off"] == []
