"""
Export a checkpoint to a Hugging Face directory that transformers loads with identical logits
(its built-in NanoChat architecture) plus a matching tokenizer and chat template.

  python -m scripts.export_hf --out hf/d20                       # latest base checkpoint
  python -m scripts.export_hf -i sft -g d20 -s 700 --out hf/d20-sft --dtype bfloat16

The logic lives in nanochat/interop/hf_export.py; this script only parses flags.
"""

import argparse

from nanochat.common import resolve_device_type, run_main
from nanochat.interop.hf_export import EXPORT_DTYPES, export_checkpoint


def main():
    p = argparse.ArgumentParser(description="Export a nanochat checkpoint to a Hugging Face transformers directory.")
    p.add_argument("-i", "--source", default="base", choices=["base", "mid", "sft", "rl"],
                   help="which stage's checkpoint")
    p.add_argument("-g", "--model-tag", default=None, help="checkpoint tag (default: the most recent one)")
    p.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="directory to create; must not exist, or be empty (a symbolic link: its target)")
    p.add_argument("--dtype", default="float32", choices=sorted(EXPORT_DTYPES), help="dtype of the exported weights")
    p.add_argument("--device-type", default="cpu", help="device to load the checkpoint on (cuda|mps|cpu; default cpu)")
    args = p.parse_args()
    device = resolve_device_type(args.device_type)
    export_checkpoint(args.source, args.out, model_tag=args.model_tag, step=args.step, dtype_name=args.dtype,
                      device=device)


if __name__ == "__main__":
    run_main(main)
