"""
Where training text comes from, beside the shards themselves (nanochat/dataset.py) and the batches
(nanochat/dataloader.py): the one HTTP download (download.py), the Hugging Face hub without its libraries (hub.py), your
own text as a source (text_import.py), the built-in world and its documents (builtin/), and the two corpora written as
sources: the built-in corpus (corpus.py; `python -m nanochat.corpus`) and the Brown corpus (brown.py;
`python -m scripts.brown`).
"""
