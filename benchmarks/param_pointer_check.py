"""On CUDA: every offloaded parameter's data pointer equals its master's (the test that
runtime/chunk_transfers.py sync_writes makes for a parameter given another tensor), no chunk taken
in as rebound over plain steps, and a parameter given another tensor made a view of its master
again.

    OUT=DIR python benchmarks/param_pointer_check.py   # writes DIR/ptrcheck.json
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
from models import build

from protrain_fx.runtime.chunk_store import live_stores

torch.manual_seed(0)
m = build("gpt", n_layer=4, n_embd=256, n_head=8, block_size=128, vocab_size=8192).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
c = torch.compile(m, backend="protrain", options={"n_persist": 1, "chunk_size": 8 << 20})
g = torch.Generator().manual_seed(0)
for _ in range(3):
    x = torch.randint(0, 8192, (4, 128), generator=g).cuda()
    y = torch.randint(0, 8192, (4, 128), generator=g).cuda()
    c(x, y).backward()
    opt.step()
    opt.zero_grad()
same = diff = 0
for s in live_stores():
    for i, e in enumerate(s.entries):
        p = s.param(i)
        if p is None or not s.is_offloaded(e.chunk) or not s.aliased:
            continue
        if p.data_ptr() == s._master_ptr(i):
            same += 1
        else:
            diff += 1
refresh = sum(s.stats.get("transfer_refreshes", 0) for s in live_stores())
w = m.blocks[2].mlp.fc.weight
w.data = w.data.clone() * 0.5
x = torch.randint(0, 8192, (4, 128), generator=g).cuda()
y = torch.randint(0, 8192, (4, 128), generator=g).cuda()
c(x, y).backward()
opt.step()
opt.zero_grad()
s = next(s for s in live_stores() if any(s.param(i) is w for i in range(len(s.entries))))
i = next(i for i in range(len(s.entries)) if s.param(i) is w)
out = {
    "offloaded_params_at_their_master": same,
    "elsewhere": diff,
    "transfer_refreshes_in_3_plain_steps": refresh,
    "rebound_param_back_at_master": w.data_ptr() == s._master_ptr(i),
}
print(json.dumps(out))
json.dump(out, open(os.path.join(os.environ["OUT"], "ptrcheck.json"), "w"))
