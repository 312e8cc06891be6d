"""
Where training text comes from, beside the shards themselves (nanochat/dataset.py) and the batches
(nanochat/dataloader.py): the one HTTP download (download.py), the Hugging Face hub without its libraries (hub.py), your
own text as a source (text_import.py), and the built-in world and its documents (builtin/). The built-in corpus and the
Brown corpus keep their commands at `python -m nanochat.corpus` and `python -m nanochat.brown`.
"""
