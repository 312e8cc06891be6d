"""
Faster ways to run the model's same math (an add-on): the CPU's hand-written training kernels (cpu.py) and fp8
matmuls (fp8.py), each a module swap after the model is built, and the decode step captured as CUDA graphs
(decode_graphs.py), swapped into a BatchEngine after it is built.
"""
