"""
The math every training stage shares: the depth dial (model shape, learning rates, weight decay and the number of
tokens from one number), the recipe components, the optimizers' setup and gradient-accumulation arithmetic.
"""

import math
from dataclasses import asdict, dataclass

import torch

from nanochat.common import UserError
from nanochat.engine import Engine
from nanochat.gpt import COMPONENTS, GPT, VARIANT_DEFAULTS, GPTConfig
from nanochat.optim import build_adamw, build_muon

REFERENCE_BATCH = 2**19  # tokens per step of the GPU recipe, where the base lrs below were tuned
BASE_LRS = {"embedding_lr": 0.2, "unembedding_lr": 0.004, "matrix_lr": 0.02}  # at REFERENCE_BATCH
BASE_WEIGHT_DECAY, BASE_DEPTH = 0.2, 12  # Muon weight decay at depth 12 and REFERENCE_BATCH
# Short runs want hotter lrs: the base lrs from LONG_RUN_STEPS optimizer steps up, SHORT_RUN_LR_SCALE times them
# at SHORT_RUN_STEPS and below (see short_run_lr_scale)
LONG_RUN_STEPS, SHORT_RUN_STEPS, SHORT_RUN_LR_SCALE = 700, 100, 2.0
SCALAR_LR = 0.005  # AdamW lr of the optional components' scalars and gates (gpt.COMPONENTS), at any batch


# -----------------------------------------------------------------------------
# The depth dial


@dataclass
class Recipe:
    """Everything the depth dial decides for a run."""
    model_config: GPTConfig
    embedding_lr: float
    unembedding_lr: float
    matrix_lr: float
    weight_decay: float
    num_iterations: int
    steps_from: str  # which flag set num_iterations
    num_params: int
    scaling_params: int  # parameters that cost FLOPs (all but the embedding lookup)
    flops_per_token: int

    def lrs(self):
        return {"embedding_lr": self.embedding_lr, "unembedding_lr": self.unembedding_lr,
                "matrix_lr": self.matrix_lr, "weight_decay": self.weight_decay}


def model_config_for_depth(depth, vocab_size, sequence_len, aspect_ratio=64, head_dim=128, n_kv_head=None, components=()):
    """
    n_layer = depth, n_embd = aspect_ratio * depth rounded up to a multiple of head_dim, n_head = n_embd / head_dim;
    `components` names the optional model components (gpt.COMPONENTS) to switch on.
    """
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown:
        raise UserError(f"unknown model component(s) {', '.join(unknown)}; known: {', '.join(COMPONENTS)}")
    for flag, value in (("--depth", depth), ("--aspect-ratio", aspect_ratio), ("--head-dim", head_dim),
                        ("--max-seq-len", sequence_len)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1 (got {value})")
    if head_dim % 2:
        raise UserError(f"--head-dim must be even for rotary embeddings (got {head_dim})")
    n_embd = ((aspect_ratio * depth + head_dim - 1) // head_dim) * head_dim
    n_head = n_embd // head_dim
    n_kv_head = n_kv_head or n_head
    if n_kv_head < 1 or n_head % n_kv_head != 0:
        raise UserError(f"--num-kv-heads={n_kv_head} must be >= 1 and divide the number of heads ({n_head})")
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_kv_head,
                     n_embd=n_embd, **{name: True for name in components})


def batch_lr_scale(total_batch_size, exponent=0.0):
    """How the base lrs (tuned at 2^19 tokens per step) change with the batch: lr *= (batch/2^19)^exponent. The default
    0 keeps them at every batch size: the square-root rule leaves small-batch runs badly undertrained (measured in
    docs/pretraining.md "The depth dial at small batch")."""
    return (total_batch_size / REFERENCE_BATCH) ** exponent


def default_weight_decay(depth, total_batch_size=REFERENCE_BATCH):
    """Weight decay on Muon matrices: 0.2 at depth 12 and 2^19 tokens per step, proportional to 1/depth^2, and shrunk
    with the square root of the batch (decay is applied per step, and small batches take many more steps per token)."""
    return BASE_WEIGHT_DECAY * (BASE_DEPTH / depth) ** 2 * (total_batch_size / REFERENCE_BATCH) ** 0.5


def short_run_lr_scale(num_iterations):
    """How much hotter than the base lrs a run of this many optimizer steps trains: 1 from 700 steps up (every long
    recipe), 2 at 100 and below, log-linear in the step count between (1.56 at 200); the best lr depends on the
    horizon (docs/pretraining.md "Short runs train hotter")."""
    steps = min(max(num_iterations, SHORT_RUN_STEPS), LONG_RUN_STEPS)
    return SHORT_RUN_LR_SCALE ** (math.log(LONG_RUN_STEPS / steps) / math.log(LONG_RUN_STEPS / SHORT_RUN_STEPS))


def dial_lr_scale(total_batch_size, lr_batch_exponent=0.0, num_iterations=None):
    """What the dial multiplies the base lrs by: the batch rule, times the short-run raise when num_iterations is given."""
    return batch_lr_scale(total_batch_size, lr_batch_exponent) * (
        1.0 if num_iterations is None else short_run_lr_scale(num_iterations))


def dial_lrs(depth, total_batch_size, lr_batch_exponent=0.0, num_iterations=None):
    """The three learning rates and Muon's weight decay the dial gives a model of this depth at this batch size, raised
    for a short run when num_iterations is given (the chat stages, which set theirs by --init-lr-frac, do not)."""
    scale = dial_lr_scale(total_batch_size, lr_batch_exponent, num_iterations)
    return {**{name: lr * scale for name, lr in BASE_LRS.items()},
            "weight_decay": default_weight_decay(depth, total_batch_size)}


def depth_recipe(depth, vocab_size, sequence_len, total_batch_size, aspect_ratio=64, head_dim=128, n_kv_head=None,
                 lr_batch_exponent=0.0, embedding_lr=None, unembedding_lr=None, matrix_lr=None, weight_decay=None,
                 num_iterations=None, target_flops=None, target_param_data_ratio=20.0, short_run_lrs=True, components=()):
    """
    The whole run from (depth, batch): model shape, the dial's lrs (raised for a short run with short_run_lrs) and
    Muon weight decay, each unless given, and the steps: the first of num_iterations, target_flops,
    target_param_data_ratio (tokens per parameter) given. `components`: optional model components to switch on.
    """
    config = model_config_for_depth(depth, vocab_size, sequence_len, aspect_ratio, head_dim, n_kv_head, components)
    with torch.device("meta"):  # shapes only: counts parameters and FLOPs without allocating anything
        model = GPT(config)
    num_params = model.num_params()
    scaling_params = num_params - model.embedding_params()  # an embedding lookup costs no FLOPs
    flops_per_token = model.estimate_flops()
    if num_iterations:
        steps_from = "--num-iterations"
    elif target_flops:
        num_iterations, steps_from = round(target_flops / (flops_per_token * total_batch_size)), "--target-flops"
    elif target_param_data_ratio:
        num_iterations = round(target_param_data_ratio * scaling_params / total_batch_size)
        steps_from = "--target-param-data-ratio"
    else:
        raise UserError("say how long to train: --num-iterations, --target-flops or --target-param-data-ratio > 0")
    num_iterations = max(1, num_iterations)
    dial = dial_lrs(depth, total_batch_size, lr_batch_exponent, num_iterations if short_run_lrs else None)
    return Recipe(
        model_config=config,
        embedding_lr=embedding_lr or dial["embedding_lr"],
        unembedding_lr=unembedding_lr or dial["unembedding_lr"],
        matrix_lr=matrix_lr or dial["matrix_lr"],
        weight_decay=dial["weight_decay"] if weight_decay is None else weight_decay,
        num_iterations=num_iterations, steps_from=steps_from,
        num_params=num_params, scaling_params=scaling_params, flops_per_token=flops_per_token,
    )


def grad_accum_steps(total_batch_size, device_batch_size, seq_len, world_size):
    """Micro-steps per optimizer step; refuses (before any compute) a split that is not exact."""
    tokens_per_micro = device_batch_size * seq_len * world_size
    if total_batch_size <= 0 or device_batch_size <= 0:
        raise UserError(f"--total-batch-size and --device-batch-size must be positive (got {total_batch_size}, {device_batch_size})")
    if total_batch_size % tokens_per_micro != 0:
        raise UserError(
            f"--total-batch-size={total_batch_size} is not a multiple of device_batch_size*seq_len*world_size = "
            f"{device_batch_size}*{seq_len}*{world_size} = {tokens_per_micro}; pick a total batch that is a multiple of it")
    return total_batch_size // tokens_per_micro


# -----------------------------------------------------------------------------
# Optimizers and one step


OPTIMIZER_COMPONENTS = ("normuon", "cautious_wd", "polar_express", "muoneq", "muon_plus")  # Muon options (nanochat.optim)
# What a new base model gets unless --components says otherwise: the components that lowered real-text val bpb at equal
# FLOPs beyond seed noise at d4 and d6 (BENCHMARKS "Recipe components, one at a time"). 'none' asks for the plain recipe.
DEFAULT_COMPONENTS = "value_embeds,residual_scalars,smear,normuon"


def split_components(text):
    """'a,b,c' -> (model components, optimizer components), each in its canonical order; 'none' (or '') is the plain
    recipe; an unknown name is refused."""
    names = [name.strip() for name in text.split(",") if name.strip() and name.strip() != "none"]
    unknown = sorted(set(names) - set(COMPONENTS) - set(OPTIMIZER_COMPONENTS))
    if unknown:
        raise UserError(f"--components: unknown component(s) {', '.join(unknown)}; known: "
                        f"{', '.join(COMPONENTS + OPTIMIZER_COMPONENTS)}")
    return [n for n in COMPONENTS if n in names], [n for n in OPTIMIZER_COMPONENTS if n in names]


def canonical_components(text):
    """One spelling of a components list, canonical order, '' for the plain recipe ('smear,value_embeds' and
    'value_embeds,smear' are the same recipe); an unknown name is refused."""
    return ",".join(sum(split_components(text), []))


def build_optimizers(model, unembedding_lr, embedding_lr, matrix_lr, weight_decay, adam_betas=(0.8, 0.95),
                     scalar_lr=SCALAR_LR, optimizer_components=()):
    """
    Muon for the blocks' matrices, AdamW for the embeddings, lm_head and the components' scalars; sharded across
    ranks when distributed. `optimizer_components` names Muon options (OPTIMIZER_COMPONENTS) to switch on.
    """
    unknown = sorted(set(optimizer_components) - set(OPTIMIZER_COMPONENTS))
    if unknown:
        raise UserError(f"unknown optimizer component(s) {', '.join(unknown)}; known: {', '.join(OPTIMIZER_COMPONENTS)}")
    adamw_groups, muon_groups = model.setup_optimizers(
        unembedding_lr=unembedding_lr, embedding_lr=embedding_lr, matrix_lr=matrix_lr,
        weight_decay=weight_decay, adam_betas=adam_betas, scalar_lr=scalar_lr)
    for group in muon_groups:
        group.update({name: True for name in optimizer_components})
    return [build_adamw(adamw_groups), build_muon(muon_groups)]


def optimizer_components_of(optimizers):
    """The Muon options (OPTIMIZER_COMPONENTS) these optimizers run with, for checkpoint meta."""
    return [name for name in OPTIMIZER_COMPONENTS
            if any(group.get(name) for opt in optimizers for group in opt.param_groups)]


def greedy_samples(model, tokenizer, prompts, max_tokens=16):
    """Greedy continuations of short prompts by the engine, for a quick look at what the model has learned: each
    prompt and what follows it, up to <|bos|> (or <|assistant_end|>, which pretraining text never holds)."""
    engine, bos = Engine(model, tokenizer), tokenizer.get_bos_token_id()
    out = []
    for prompt in prompts:
        (ids,), _ = engine.generate_batch(tokenizer.encode(prompt, prepend=bos), max_tokens=max_tokens, temperature=0.0)
        out.append(tokenizer.decode(ids[1:]))
    return out


def config_dict(config):
    """A GPTConfig as the plain dict of checkpoint meta, leaving out components that are off, the value embeddings'
    placement when there are none and exact-math variants at their default (gpt.VARIANT_DEFAULTS): a plain model's
    meta is the same as before they existed, and a missing one reads as off."""
    return {name: value for name, value in asdict(config).items() if not (name in COMPONENTS and value is False)
            and not (name == "value_embed_layers" and not config.value_embeds)
            and not (name in VARIANT_DEFAULTS and value == VARIANT_DEFAULTS[name])}
