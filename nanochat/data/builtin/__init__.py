"""
The built-in world, generated from a seed with no network, and everything nanochat makes of it offline: `world` (its
entities, facts and English templates, and the subjects held out for eval), `documents` (pretraining documents about
it), `drills` (arithmetic and spelling documents) and `core_bundle` (a CORE eval bundle about it, in DCLM's format).
"""
