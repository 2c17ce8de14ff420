"""Tests on real test infrastructure: network-namespace hosts, Slurm, sshd, MPI launchers (root only)."""
