"""
What a stage runs with when a flag is not given: a preset picked by the device. gpu (a CUDA device): the GPU recipe's
sizes (a d20, 2^19-token steps of 2048-token rows, evaluations of millions of tokens, epochs of the chat data);
cpu (anything else): the offline CPU pipeline's (a d4 on 256-token rows, 2048-token steps, a few hundred steps per
stage; minutes per stage on 2 cores). speedrun.sh's cpu preset passes the same numbers explicitly (a test keeps them
in step), its gpu preset changes some. A flag given on the command line always wins; a stage prints what it filled.
"""

from nanochat.common import resolve_device_type
from nanochat.recipe import REFERENCE_BATCH

PRESETS = {
    "base_train": {
        "gpu": dict(depth=20, max_seq_len=2048, device_batch_size=32, total_batch_size=REFERENCE_BATCH, num_iterations=-1,
                    eval_every=250, eval_tokens=20 * REFERENCE_BATCH, core_metric_every=2000, sample_every=2000),
        "cpu": dict(depth=4, max_seq_len=256, device_batch_size=8, total_batch_size=2048, num_iterations=700,
                    eval_every=100, eval_tokens=32768, core_metric_every=-1, sample_every=350),
    },
    "base_loss": {
        "gpu": dict(device_batch_size=32, split_tokens=20 * REFERENCE_BATCH),
        "cpu": dict(device_batch_size=8, split_tokens=65536),
    },
    "base_eval": {
        "gpu": dict(max_per_task=-1),
        "cpu": dict(max_per_task=100),
    },
    "mid_train": {
        "gpu": dict(device_batch_size=32, total_batch_size=REFERENCE_BATCH, num_iterations=-1, init_lr_frac=1.0, eval_steps=8),
        "cpu": dict(device_batch_size=8, total_batch_size=4096, num_iterations=60, init_lr_frac=0.05, eval_steps=4),
    },
    "chat_sft": {
        "gpu": dict(device_batch_size=4, total_batch_size=32, num_iterations=-1, init_lr_frac=0.02, eval_steps=8),
        "cpu": dict(device_batch_size=16, total_batch_size=32, num_iterations=300, init_lr_frac=0.1, eval_steps=8),
    },
    "chat_rl": {
        "gpu": dict(device_batch_size=8, total_batch_size=16, num_iterations=-1, init_lr_frac=0.05, num_samples=16,
                    max_new_tokens=256, eval_every=-1, eval_problems=200),
        "cpu": dict(device_batch_size=16, total_batch_size=8, num_iterations=30, init_lr_frac=0.05, num_samples=8,
                    max_new_tokens=48, eval_every=15, eval_problems=64),
    },
    "chat_eval": {
        "gpu": dict(max_problems=-1, max_new_tokens=256),
        "cpu": dict(max_problems=200, max_new_tokens=48),
    },
}


def preset_for(device_type=""):
    """gpu on a CUDA device, cpu on anything else (a CPU, or a laptop's MPS)."""
    return "gpu" if resolve_device_type(device_type) == "cuda" else "cpu"


def preset_help(stage, flag):
    """The help text's default: what each preset gives this flag."""
    return f"(default: {PRESETS[stage]['gpu'][flag]} on a GPU, {PRESETS[stage]['cpu'][flag]} on a CPU)"


def fill_from_preset(args, stage, leave=()):
    """
    Set every flag of this stage's preset that was not given (None) from the preset of args.device_type's device, and
    args.preset to a note for the config line: the preset and the flags it filled ("" when every one was given).
    Flags in `leave` stay None (a time budget decides them).
    """
    name = preset_for(getattr(args, "device_type", ""))
    filled = []
    for flag, value in PRESETS[stage][name].items():
        if getattr(args, flag) is None and flag not in leave:
            setattr(args, flag, value)
            filled.append(f"--{flag.replace('_', '-')}={value}")
    args.preset = f"{name} preset: {' '.join(filled)}" if filled else ""
    return args
