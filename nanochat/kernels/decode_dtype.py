"""
The dtype a CPU decodes in (chat_cli, chat_web, chat_eval). Where a CPU multiplies bf16 natively, bf16 is the
training's compute dtype, but a decode step is a few small matmuls a token, and bf16's fixed costs per op can make it
the slower one (an Intel Xeon with AMX decoded 256 tokens of a d4 in ~2.0 s at bf16 against ~0.6 s in fp32).
`use_fastest_decode_dtype` times a decode step in both on a stand-in of the model's shape before the model loads, and
sets NANOCHAT_DTYPE to the faster for the rest of the process (and the workers it starts), so that the model loads,
prepares (GPT.prepare_for_inference) and decodes in it: fp32 unless bf16 is clearly faster, so never slower than fp32.
A NANOCHAT_DTYPE already set is the user's choice, kept; a GPU decodes in its compute dtype, as it trains.
"""

import contextlib
import dataclasses
import os
import time

import torch

from nanochat.checkpoint_manager import checkpoint_dir, find_latest_tag, load_meta, resolve_step
from nanochat.common import bound_onednn_caches, get_compute_dtype, has_fast_bf16, print0
from nanochat.engine import BatchEngine, Sampling
from nanochat.gpt import build_model, config_from_dict
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.kernels.int8 import quantize_int8

DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
STAND_IN_LAYERS = 4  # blocks of the stand-in at most: a deeper model's step is more of the same blocks
BF16_MARGIN = 0.9  # bf16 is chosen only below this share of fp32's step time: within the noise, fp32 (exact) stays
PROMPT_TOKENS = 16
STEPS, ROUNDS = 8, 5  # steps timed in a row (their mean), rounds alternating the dtypes (the fastest round counts)


def checkpoint_config(source, model_tag=None, step=None):
    """The model_config of the checkpoint load_model would load, read before loading it."""
    ckpt_dir = checkpoint_dir(source, model_tag or find_latest_tag(source))
    return load_meta(ckpt_dir, resolve_step(ckpt_dir, step, fix="train that stage first, or check -i / -g"))[
        "model_config"]


@contextlib.contextmanager
def _decoding_in(dtype):
    """NANOCHAT_DTYPE set to `dtype` while a stand-in is built, prepared and given its engine (each reads it then)."""
    before = os.environ.get("NANOCHAT_DTYPE")
    os.environ["NANOCHAT_DTYPE"] = DTYPE_NAME[dtype]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NANOCHAT_DTYPE", None)
        else:
            os.environ["NANOCHAT_DTYPE"] = before


def stand_in_engine(config, tokenizer, dtype, rows, int8=False):
    """A BatchEngine on a random model of `config`'s shape (at most STAND_IN_LAYERS blocks) as chat_cli would serve it
    in `dtype`, with `rows` sequences that have their prompt in and never stop."""
    config = config_from_dict(config) if isinstance(config, dict) else config
    try:
        config = dataclasses.replace(config, n_layer=min(config.n_layer, STAND_IN_LAYERS))
    except ValueError:  # per-layer fields that name deeper layers: the whole depth, then
        pass
    with _decoding_in(dtype):
        model = use_cpu_kernels(build_model(config, "cpu"), "cpu").eval().prepare_for_inference()
        if int8:
            quantize_int8(model)
        engine = BatchEngine(model, tokenizer, rows, prefill_chunk=rows * PROMPT_TOKENS)
    never_stop = {token: -1e4 for token in engine.ids.terminals}  # random weights may well pick a stop token
    for row in range(rows):
        engine.add([tokenizer.get_bos_token_id()] + [row] * (PROMPT_TOKENS - 1),
                   Sampling(temperature=0.0, max_tokens=STEPS * (ROUNDS + 1) + 2, logit_bias=never_stop))
    with torch.inference_mode():
        engine.step()  # the prompts
        for _ in range(STEPS):  # a warm-up: a new shape's first calls are slower
            engine.step()
    return engine


def time_decode_dtypes(config, tokenizer, rows=(1,), int8=False, dtypes=(torch.float32, torch.bfloat16)):
    """{dtype: seconds}, a decode step of the stand-in at each row count in `rows`, summed: the fastest round of STEPS
    steps, the dtypes taking turns so that a burst of other work slows both alike."""
    bound_onednn_caches()  # before the first matmul, as a bf16 model's preparation would (oneDNN reads it once)
    engines = {(dtype, n): stand_in_engine(config, tokenizer, dtype, n, int8) for dtype in dtypes for n in rows}
    best = dict.fromkeys(engines, float("inf"))
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for key, engine in engines.items():
                started = time.perf_counter()
                for _ in range(STEPS):
                    engine.step()
                best[key] = min(best[key], (time.perf_counter() - started) / STEPS)
    return {dtype: sum(best[dtype, n] for n in rows) for dtype in dtypes}


def use_fastest_decode_dtype(device, config, tokenizer, rows=(1,), int8=False, say=print0):
    """Set NANOCHAT_DTYPE to the dtype a decode step of a model of `config`'s shape is fastest in on this CPU (rows:
    the batch sizes the caller decodes at) and return it; elsewhere, or with NANOCHAT_DTYPE set, the compute dtype
    unchanged. Call it before the model loads. say: where the line on the choice goes (chat_cli's: stderr)."""
    device = torch.device(device)
    if device.type != "cpu" or os.environ.get("NANOCHAT_DTYPE"):
        return get_compute_dtype(device)
    if not has_fast_bf16(device):  # bf16 emulated: fp32, the compute dtype already, is faster for certain
        return torch.float32
    seconds = time_decode_dtypes(config, tokenizer, rows, int8)
    chosen = torch.bfloat16 if seconds[torch.bfloat16] < BF16_MARGIN * seconds[torch.float32] else torch.float32
    os.environ["NANOCHAT_DTYPE"] = DTYPE_NAME[chosen]
    say(f"decoding in {DTYPE_NAME[chosen]}: a step of this model's shape took {1e3 * seconds[torch.float32]:.2f} ms "
           f"in float32, {1e3 * seconds[torch.bfloat16]:.2f} ms in bfloat16 on this CPU "
           f"(NANOCHAT_DTYPE=float32|bfloat16 chooses)")
    return chosen
