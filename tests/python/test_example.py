import os
import subprocess
import sys

from conftest import ROOT


def test_batch_generator_report_example_buffers_flat():
    # The example at 4,000 tokens (CI time); the 20,000 is its default.
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "batch_generator_buffers.py"),
         "--model", os.path.join(ROOT, "models", "qwen3next-seed-48L"), "--tokens", "4000"],
        capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [l.split()[1] for l in lines[:-1]] == ["1000", "2000", "3000", "4000"]
    assert lines[-1].endswith("identical")
    buffers = {l.split()[4] for l in lines[:-1]}
    assert len(buffers) == 1
