"""All-Reduce example (the tutorial's group `run`)."""

import torch

import procgroup as dist


def run(rank, size):
    """Simple collective communication."""
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(dist.get_rank(), dist.get_world_size())
