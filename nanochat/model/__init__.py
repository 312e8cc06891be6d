"""
Beside the model itself (nanochat/gpt.py): how its operations run fast, the hand-written CPU kernels (cpu_ops.py) and
fp8 matmuls for training (fp8.py); karpathy/nanochat's KVCache (kv_cache.py), the cache of a model written against
that project, which nanochat.engine re-exports; and the model in and out of other formats: karpathy/nanochat
checkpoints of every era and transformers directories in (model_import.py), a Hugging Face directory out (hf_export.py,
with the modeling code it may ship: hf_recipe_model.py).
"""
