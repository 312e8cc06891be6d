"""
The built-in world: a small synthetic world of invented countries and people, generated from a
seed with no network, and everything nanochat makes of it offline.

    world        the entities, their facts (seven relations) and the English templates that tell them;
                 the split of subjects into those chat stages may ask about and those held out for eval
    documents    pretraining documents about the world in varied styles
    drills       arithmetic and spelling documents
    core_bundle  a CORE eval bundle about the world, in the published DCLM format

`python -m nanochat.corpus` writes the pretraining shards from these; the chat tasks
(the top-level tasks/ package, beside nanochat/) build their conversations from `world` and `drills` directly.
"""
