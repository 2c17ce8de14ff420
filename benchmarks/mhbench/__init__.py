"""The multi-host benchmark behind ``benchmarks/multihost.py``, split along its seams."""
