"""
Beside the model itself (nanochat/gpt.py): how its operations run fast, the hand-written CPU kernels (cpu_ops.py) and
fp8 matmuls for training (fp8.py); and karpathy/nanochat's KVCache (kv_cache.py), the cache of a model written against
that project, which nanochat.engine re-exports.
"""
