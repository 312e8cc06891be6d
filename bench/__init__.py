"""
The measuring tools, kept out of the library (nothing in nanochat/ imports them): the benchmarks behind
BENCHMARKS.md, one module each (train, dataloader, tokenizer, engine, kernels, importing, serve, quality, budget, wordings) with
what they share in common.py (`python -m scripts.bench SUBCOMMAND`), and what `python -m scripts.gpu_check` measures
on a GPU node (gpu_check.py) and its suite (gpu_suite.py, with reference_train.py run against karpathy/nanochat),
and the miniseries (miniseries.py, `python -m scripts.miniseries`: families of base_train runs and their scaling fits).
"""
