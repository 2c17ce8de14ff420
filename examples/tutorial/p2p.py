"""Blocking point-to-point communication (the tutorial's `run`)."""

import torch

import procgroup as dist


def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(dist.get_rank(), dist.get_world_size())
