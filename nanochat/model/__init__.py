"""
How the model's operations run fast, beside the model itself (nanochat/gpt.py): the hand-written CPU kernels
(cpu_ops.py) and fp8 matmuls for training (fp8.py).
"""
