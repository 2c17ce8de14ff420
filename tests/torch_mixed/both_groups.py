"""Worker: torch.distributed's gloo group and procgroup's group in one process, in the order given by argv[1]."""

import sys

import numpy as np
import torch
import torch.distributed as td

import procgroup as pg

order = sys.argv[1]
if order == "torch-first":
    td.init_process_group("gloo")
    pg.init_process_group()
else:
    pg.init_process_group()
    td.init_process_group("gloo")
t = torch.ones(2)
td.all_reduce(t)
a = np.ones(2)
pg.all_reduce(a)
sys.stdout.write(f"OK {td.get_rank()} {pg.get_rank()} {t.tolist()} {a.tolist()}\n")  # one write: no interleaving
sys.stdout.flush()
pg.destroy_process_group()
td.destroy_process_group()
