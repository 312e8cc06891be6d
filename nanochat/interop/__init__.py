"""
The model in from other formats and out to them (an add-on): karpathy/nanochat checkpoints of every era and
transformers directories in (model_import.py), a Hugging Face directory out (hf_export.py, with the modeling code it
ships when transformers' NanoChat cannot hold a recipe component: hf_recipe_model.py).
"""
