"""
The built-in world (an add-on: the core reads its shards as it reads any source's), generated from a seed with no
network, and everything nanochat makes of it offline: `world` (its entities, facts and English templates, and the
subjects held out for eval), `documents` (pretraining documents about it), `drills` (arithmetic and spelling documents),
`core_bundle` (a CORE eval bundle about it, in DCLM's format) and `build` (all of it written as the source `builtin`,
`python -m nanochat.corpus`: __main__.py).
"""
