"""
Models in and out of other formats: karpathy/nanochat checkpoints of every era and transformers directories in
(model_import.py), a Hugging Face directory out (hf_export.py, with the modeling code it may ship: hf_recipe_model.py).
"""
