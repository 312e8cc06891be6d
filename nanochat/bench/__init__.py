"""
The benchmarks behind BENCHMARKS.md, one module each (train, dataloader, tokenizer, engine, quality), with what
they share in common.py. `python -m scripts.bench SUBCOMMAND` runs them; see its docstring for the commands.
"""
