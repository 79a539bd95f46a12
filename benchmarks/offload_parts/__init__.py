"""The parts of ``benchmarks/offload.py``, a module for one or two of them, and the rows they measure."""
