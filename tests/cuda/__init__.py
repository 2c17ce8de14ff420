"""Tests that need a CUDA device (run on a GPU machine; they skip, saying why, everywhere else)."""
