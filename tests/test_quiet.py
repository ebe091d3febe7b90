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
