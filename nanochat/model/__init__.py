"""
Beside the model (nanochat/gpt.py): CPU kernels (cpu_ops.py) and fp8 matmuls (fp8.py); karpathy/nanochat's KVCache
(kv_cache.py, re-exported by nanochat.engine); the model in from other formats (model_import.py) and out to a Hugging
Face directory (hf_export.py, with the modeling code it may ship: hf_recipe_model.py).
"""
