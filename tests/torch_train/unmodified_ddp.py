"""A plain torch DDP training script, as a user would write it for gloo (no procgroup import anywhere).

test_train.py runs it as is and with only ``backend="gloo"`` changed to ``backend="procgroup"`` (the backend then
comes from torch's entry-point autoload), and compares the saved parameters bit for bit.
usage: unmodified_ddp.py OUTDIR
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group(backend="gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(5):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
if rank == 0:
    torch.save([p.detach() for p in model.parameters()], sys.argv[1])
dist.destroy_process_group()
