"""
Bring a model you already have: a karpathy/nanochat checkpoint (any public era) or a transformers NanoChat directory
becomes an ordinary checkpoint of this base dir, with the same logits.

  python -m scripts.import_model ~/.cache/nanochat/chatsft_checkpoints/d32 --as sft     # a karpathy/nanochat base dir
  python -m scripts.import_model karpathy/nanochat-d32 --as sft                         # a hub repo (HF_ENDPOINT honoured)
  python -m scripts.import_model ./hf/d20 --as base --model-tag d20                     # a transformers directory

The logic lives in nanochat/interop/model_import.py; docs/import.md says what is checked and what each era maps to.
"""

import argparse

from nanochat.checkpoint_manager import STAGE_DIRS
from nanochat.common import run_main
from nanochat.interop.model_import import ERAS, import_model


def main(argv=None):
    p = argparse.ArgumentParser(description="Import a karpathy/nanochat checkpoint or a transformers NanoChat model.")
    p.add_argument("source", help="a local checkpoint folder, or a hub repo as owner/name[@revision]")
    p.add_argument("--as", dest="stage", required=True, choices=list(STAGE_DIRS),
                   help="which stage's checkpoints it joins (base, mid, sft, rl)")
    p.add_argument("--model-tag", default=None, help="its tag there (default: the source folder's or repo's name; "
                   "NAME-imported when that folder is karpathy/nanochat's own, as in its base dir ~/.cache/nanochat)")
    p.add_argument("--step", type=int, default=None, help="karpathy/nanochat: which model_XXXXXX.pt (default: the last)")
    p.add_argument("--tokenizer", default=None,
                   help="karpathy/nanochat: tokenizer.pkl or its folder (default: beside the model, in its "
                   "tokenizer/, one folder up, or ../../tokenizer)")
    p.add_argument("--era", default=None, choices=list(ERAS),
                   help="karpathy/nanochat: the model code's era where its files cannot tell (2026-01, 2026-03-02 or "
                   "2026-03-04 look alike); one its files rule out is refused (default: detected)")
    args = p.parse_args(argv)
    import_model(args.source, args.stage, model_tag=args.model_tag, step=args.step, tokenizer_path=args.tokenizer,
                 era=args.era)


if __name__ == "__main__":
    run_main(main)
