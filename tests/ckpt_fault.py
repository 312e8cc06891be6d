"""
Run scripts.base_train with a kill injected into one checkpoint save, from outside the library:

    python tests/ckpt_fault.py <point>@<step> [base_train flags...]

point: after_optimizer (optimizer shards written, weights not yet), after_model (weights written, meta not
yet), before_rename (everything written, the temp dir not yet renamed into place). The process dies with
os._exit(137), as a SIGKILL would leave it.
"""

import os
import sys

from nanochat import checkpoint_manager
from scripts import base_train

point, step = sys.argv[1].split("@")
temp_dir_name = f".tmp_step_{int(step):06d}"
real_save_file, real_replace = checkpoint_manager.save_file, checkpoint_manager.os.replace


def save_file(tensors, path, *args, **kwargs):
    in_target_save = os.path.basename(os.path.dirname(path)) == temp_dir_name
    if in_target_save and point == "after_optimizer" and os.path.basename(path) == "model.safetensors":
        os._exit(137)
    real_save_file(tensors, path, *args, **kwargs)
    if in_target_save and point == "after_model" and os.path.basename(path) == "model.safetensors":
        os._exit(137)


def replace(src, dst):
    if point == "before_rename" and os.path.basename(src) == temp_dir_name:
        os._exit(137)
    real_replace(src, dst)


checkpoint_manager.save_file = save_file
checkpoint_manager.os = type(os)("os_with_fault")
checkpoint_manager.os.__dict__.update(os.__dict__)
checkpoint_manager.os.replace = replace
base_train.main(sys.argv[2:])
