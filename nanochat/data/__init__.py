"""
Where training text comes from, beside the shards (nanochat/dataset.py) and the batches (nanochat/dataloader.py): the
one HTTP download, the Hugging Face hub, your own text as a source, the built-in world, and the two corpora written as
sources (the built-in corpus and Brown).
"""
