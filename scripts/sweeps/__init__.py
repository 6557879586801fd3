"""The parts of ``scripts/kernel_sweep.py``, one module per op family."""
