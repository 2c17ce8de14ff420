"""procgroup: run one Python program as a group of cooperating processes.

``import procgroup as dist`` gives the process-group API of torch.distributed
without requiring torch.  The public API is assembled in this file only.
"""

__version__ = "0.1.0"
