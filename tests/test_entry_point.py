"""backend="protrain" works in a fresh process that never imported protrain_fx (entry point)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys, torch
assert "protrain_fx" not in sys.modules
assert "protrain" in torch._dynamo.list_backends()
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
x = torch.randn(4, 8)
out = torch.compile(m, backend="protrain", options={"compiler": "eager"})(x)
out.sum().backward()
torch.testing.assert_close(out, m(x))
assert "protrain_fx.backend" in sys.modules
print("ok", sys.modules["protrain_fx"].get_plan(m).to_dict()["blocks"])
"""


def test_fresh_process_uses_the_entry_point(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # a Sequential of Linear/ReLU/Linear: two Linear children share a class, so they count as blocks
    assert (
        "ok [{'name': '0', 'policy': 'keep'}, {'name': '1', 'policy': 'keep'}, {'name': '2', "
        "'policy': 'keep'}]" in res.stdout
    )
