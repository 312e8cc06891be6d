"""`python -m nanochat.corpus` builds the built-in corpus: the command line is scripts/corpus.py, the corpus
nanochat/data/corpus.py."""

if __name__ == "__main__":
    from nanochat.common import run_main
    from scripts.corpus import main

    run_main(main)
