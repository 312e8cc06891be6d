"""
The memory of one base_train step, predicted before it runs and without its device: the peak of the bytes alive in one
optimizer step (what torch.cuda.max_memory_allocated counts) and its parts, so that a plan can choose a model, a device
batch and activation checkpointing that fit a card. The real step runs on fake tensors on the CPU standing in for the
device; a few layers are traced and the others counted as copies. How, and what it leaves out: docs/time_budget.md
"Your card's memory"; measured against the real step: `python -m bench.memory_model predict`.
"""

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import time
import weakref
from dataclasses import asdict, dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanochat.common import UserError, atomic_write_text, format_bytes, get_base_dir, parse_memory, read_json_object  # noqa: F401


# The plan fits the predicted peak into this share of the memory: the rest is for what the prediction leaves out (the
# caching allocator's ~5-10 % in a training loop, the CUDA context and cuBLAS/cuDNN workspaces, a few hundred MB)
MEMORY_SHARE = 0.9
CACHE_FILE = "memory_model.json"  # in the base dir: profiles traced before, keyed by everything they depend on
# The sources whose code decides a step's memory: a profile traced under other sources is traced again
TRACED_SOURCES = ("nanochat/gpt.py", "nanochat/kernels/fp8.py", "nanochat/kernels/cpu.py", "nanochat/optim.py",
                  "nanochat/planning/memory_model.py")


# -----------------------------------------------------------------------------
# What a step's memory depends on


@dataclass(frozen=True)
class StepSpec:
    """Everything one base_train step's memory depends on but the device batch."""
    depth: int
    seq_len: int
    vocab_size: int
    aspect_ratio: int = 64
    head_dim: int = 128
    num_kv_heads: int | None = None
    model_components: tuple = ()
    optimizer_components: tuple = ()
    dtype: str = "bfloat16"  # the compute dtype: bf16 or fp16 autocast (fp16's tables stay fp32), or float32
    fp8: bool = False
    checkpoint_activations: bool = False
    compiled: bool = True  # torch.compile'd with inductor (a GPU's step), else eager
    cpu_ops: bool = False  # the CPU's own fused Functions (nanochat.kernels.cpu): an eager step on a CPU
    device_type: str = "cuda"  # what inductor generates code for: it decides one transient of a compiled step

    def model_config(self):
        from nanochat.recipe import model_config_for_depth

        return model_config_for_depth(self.depth, self.vocab_size, self.seq_len, self.aspect_ratio, self.head_dim,
                                      self.num_kv_heads, self.model_components)


# -----------------------------------------------------------------------------
# Counting the bytes alive


class LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage alive (each once, uncounted as it dies; each with the `owner` set when it was
    allocated), with the peak since reset_peak(). A read of a value on the host (.item(), bool(t)) answers 1: fake
    tensors have none, and the step's only such read (the CPU loss's "are all targets valid") is true."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.alive = {}  # id(storage) -> (bytes, owner)
        self.refs = {}  # id(storage) -> weak reference, whose callback uncounts it
        self.total = self.peak = 0
        self.owner = "static"

    def reset_peak(self):
        self.peak = self.total

    def count(self, tensor):
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.alive:
            return
        nbytes = storage.nbytes()
        self.alive[key] = (nbytes, self.owner)
        self.total += nbytes
        self.peak = max(self.peak, self.total)

        def died(_, key=key):
            self.total -= self.alive.pop(key, (0, None))[0]
            self.refs.pop(key, None)

        self.refs[key] = weakref.ref(storage, died)

    def by_owner(self):
        totals = {}
        for nbytes, owner in self.alive.values():
            totals[owner] = totals.get(owner, 0) + nbytes
        return totals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            return True if func == torch.ops.aten.is_nonzero.default else 1
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.count(t)
        return out


def storage_bytes(tensors):
    """The bytes of these tensors' storages, each storage once."""
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


@contextlib.contextmanager
def traced_as(spec):
    """The process set up to run spec's step on fake CPU tensors as its device runs it (the compute dtype), its
    optimizers as one process's (a rank of several would wait in a collective that never comes)."""
    import nanochat.optim as optim

    env = {"NANOCHAT_DTYPE": spec.dtype}
    saved, rank_world = {name: os.environ.get(name) for name in env}, optim.dist_rank_world
    os.environ.update(env)  # only this one is put back after: other threads may read the environment meanwhile
    optim.dist_rank_world = lambda: (0, 1)
    try:
        yield
    finally:
        optim.dist_rank_world = rank_world
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def fake_model(config, spec):
    """spec's model on fake CPU tensors, initialised as base_train initialises it (inside a FakeTensorMode), with the
    CPU's Functions swapped in where spec.cpu_ops says."""
    from nanochat.gpt import GPT
    from nanochat.kernels.cpu import swap_in_cpu_kernels
    from nanochat.kernels.fp8 import convert_to_fp8

    model = GPT(config)
    model.init_weights()  # also stores the embedding tables in the compute dtype
    if spec.cpu_ops:
        swap_in_cpu_kernels(model)
    if spec.fp8:
        convert_to_fp8(model)
    model.checkpoint_activations = spec.checkpoint_activations
    return model


def autocast_of(spec):
    """The step's autocast: in its 16-bit dtype (bf16, or fp16 on a GPU without bf16), none in fp32."""
    return contextlib.nullcontext() if spec.dtype == "float32" else torch.autocast("cpu", dtype=getattr(torch, spec.dtype))


# -----------------------------------------------------------------------------
# The parameters, the optimizer state, the gradients: the whole model, exactly


def trace_static(spec):
    """(parameters, optimizer state, gradients, the optimizer step's peak) of the whole model, in bytes: the peak of the
    second of two steps, with the state there, and its temporaries."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nanochat.optim import apply_schedules, muon_momentum
    from nanochat.recipe import build_optimizers, depth_recipe

    recipe = depth_recipe(spec.depth, spec.vocab_size, spec.seq_len, spec.seq_len, spec.aspect_ratio, spec.head_dim,
                          spec.num_kv_heads, num_iterations=1, components=spec.model_components)
    with traced_as(spec), FakeTensorMode(allow_non_fake_inputs=True), LiveBytes() as live:
        model = fake_model(recipe.model_config, spec)
        optimizers = build_optimizers(model, **recipe.lrs(), optimizer_components=spec.optimizer_components)
        params = list(model.parameters())
        for _ in range(2):
            for p in params:
                p.grad = torch.zeros_like(p)  # a gradient has its parameter's dtype
            gradients = storage_bytes(p.grad for p in params)
            live.reset_peak()
            apply_schedules(optimizers, 1.0, momentum=muon_momentum(0))
            for opt in optimizers:
                opt.step()
            optimizer_peak = live.peak
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
        state = [t for opt in optimizers for s in opt.state.values() for t in tree_leaves(s) if isinstance(t, torch.Tensor)]
        parameters = storage_bytes(params) + storage_bytes(model.buffers())  # the rotary tables are buffers
        # step counts on the device and anything else the optimizers keep besides the per-parameter state
        kept = live.total - parameters
        return parameters, max(storage_bytes(state), kept), gradients, optimizer_peak


# -----------------------------------------------------------------------------
# The activations: a few layers traced, the others counted as copies


def layer_kinds(config):
    """What makes one layer's activations differ from another's: its value embedding, its attention window."""
    from nanochat.gpt import attention_window, has_value_embed

    return [(has_value_embed(config, i), attention_window(config, i)) for i in range(config.n_layer)]


def reduced_layers(kinds):
    """The layers traced for a model of these layer kinds: the first layer (what comes before it is not a layer's),
    then one layer of each kind the others are; None when that is no fewer than the model has."""
    traced = [kinds[0]] + list(dict.fromkeys(kinds[1:]))
    if len(traced) == 1 and len(kinds) > 1:
        traced = traced * 2  # a second layer of the first's kind: what a layer after the first keeps
    return traced if len(traced) < len(kinds) else None


def reduced_config(config, traced):
    """config with only the traced layers (kinds as reduced_layers lists them), each placed as the original's."""
    ve_layers = [i for i, (has_ve, _) in enumerate(traced) if has_ve]
    fields = asdict(config)
    fields.update(n_layer=len(traced), value_embeds=bool(ve_layers),
                  value_embed_layers=",".join(map(str, ve_layers)) if ve_layers else "lower_half",
                  attention_windows=[window or 0 for _, window in traced])
    if config.backout_layer is not None:
        fields["backout_layer"] = min(config.backout_layer, len(traced) - 1)
    return type(config)(**fields)


@dataclass
class Activations:
    """A traced model's activations as a function of the device batch b: each quantity is fixed + per_row * b."""
    layers: list  # [(fixed, per_row)] kept at the end of the forward by each traced layer
    rest: tuple  # (fixed, per_row) kept by everything else (the embeddings, the head, the loss, the batch)
    extra: tuple  # the forward and backward's peak beyond the state before the step and what the forward keeps
    tail: tuple  # eager only: the backward's end (every gradient made) beyond the state and the gradients


def trace_eager(config, spec, batch):
    """One eager forward and backward of `config`'s model at this device batch, on fake tensors: the bytes each layer
    (and the rest) keeps at the end of the forward, the state before the step, the peak of the forward and backward,
    the peak after every block's gradients are made, and the gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with traced_as(spec), FakeTensorMode(allow_non_fake_inputs=True), LiveBytes() as live:
        model = fake_model(config, spec)
        idx = torch.zeros((batch, spec.seq_len), dtype=torch.long)
        targets = torch.zeros((batch, spec.seq_len), dtype=torch.long)
        before = live.total
        blocks = list(model.transformer.h)
        # an allocation belongs to its block, or between two blocks to the one after them (its residual mix, its value
        # embedding's lookup); before the first block and after the last to the rest (the embedding, the head, the loss)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: setattr(live, "owner", i))
            block.register_forward_hook(
                lambda m, args, out, i=i: setattr(live, "owner", i + 1 if i + 1 < len(blocks) else "rest"))
        block_params = [p for block in blocks for p in block.parameters()]
        marks = {"waiting": len(block_params)}

        def gradient_made(_):
            marks["waiting"] -= 1
            if marks["waiting"] == 0:  # every block's gradient is made: the backward's tail begins
                marks["peak_before_tail"] = live.peak
                live.reset_peak()

        for p in block_params:
            p.register_post_accumulate_grad_hook(gradient_made)
        live.owner = "rest"
        live.reset_peak()
        with autocast_of(spec):
            loss = model(idx, targets)
        at_forward_end = live.by_owner()
        loss.backward()
        tail_peak = live.peak if "peak_before_tail" in marks else live.total
        fb_peak = max(marks.get("peak_before_tail", 0), live.peak)
        gradients = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        # the parameters and the batch ("static") were there before the step
        layers, rest = [at_forward_end.get(i, 0) for i in range(len(blocks))], at_forward_end.get("rest", 0)
        kept = sum(layers) + rest
        return {"before": before, "layers": layers, "rest": rest, "tail": tail_peak, "gradients": gradients,
                "extra": fb_peak - before - kept}


def trace_eager_activations(config, spec):
    """Activations of the eager step, from two device batches (each quantity is a line in the batch). The batches make
    at least LOSS_CHUNK_ROWS rows, so that the CPU loss's chunk buffers are full-sized in both."""
    from nanochat.kernels.cpu import LOSS_CHUNK_ROWS

    small = max(1, math.ceil(LOSS_CHUNK_ROWS / spec.seq_len)) if spec.cpu_ops else 1
    a, b = trace_eager(config, spec, small), trace_eager(config, spec, 2 * small)

    def line(x, y):  # fixed + per_row * batch through (small, x) and (2 small, y)
        per_row = max(0, (y - x)) / small
        return (x - per_row * small, per_row)

    layers = [line(x, y) for x, y in zip(a["layers"], b["layers"])]
    rest = line(a["rest"], b["rest"])
    rest = (rest[0], rest[1] + 2 * spec.seq_len * 8)  # the batch, two (b, T) int64 tensors alive before the step
    extra = line(a["extra"], b["extra"])
    tail = line(a["tail"] - a["before"] - a["gradients"], b["tail"] - b["before"] - b["gradients"])
    return Activations(layers, rest, extra, tail)


def trace_compiled_activations(config, spec):
    """Activations of the compiled step: through Dynamo and AOT autograd with inductor's decompositions and partitioner
    on fake tensors (no kernels), what the forward graph hands to the backward, each tensor once, by the layer its op
    belongs to (between two blocks: the one after) and per row of the batch where it depends on the tokens."""
    import torch._dynamo
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch = 2  # not 1: a dimension of size 1 takes other paths through the decompositions
    graphs = {}

    def keep_forward(graph_module, inputs):
        graphs["forward"] = graph_module
        return make_boxed_func(graph_module.forward)

    def backend(graph_module, inputs):
        return aot_module_simplified(graph_module, inputs, fw_compiler=keep_forward,
                                     bw_compiler=lambda g, _: make_boxed_func(g.forward), partition_fn=partition_fn,
                                     decompositions=select_decomp_table())

    torch._dynamo.reset()  # a fresh trace: earlier models' graphs count against Dynamo's recompile limit
    with traced_as(spec):
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = fake_model(config, spec)
            idx = torch.zeros((batch, spec.seq_len), dtype=torch.long)
            targets = torch.zeros((batch, spec.seq_len), dtype=torch.long)
        compiled = torch.compile(model, backend=backend, dynamic=False)
        with autocast_of(spec):
            compiled(idx, targets)
    torch._dynamo.reset()
    nodes = list(graphs["forward"].graph.nodes)
    # what depends on the tokens grows with the batch; the rest (weights cast to bf16, rotary tables) does not
    per_row_nodes = set()
    for node in nodes:
        value = node.meta.get("val")
        tokens = node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dtype == torch.long \
            and tuple(value.shape) == (batch, spec.seq_len)
        if tokens or any(arg in per_row_nodes for arg in node.all_input_nodes):
            per_row_nodes.add(node)
    layer_at = [module_layer(node) for node in nodes]
    spans = {}  # layer -> [its first op's position, its last's]
    for position, layer in enumerate(layer_at):
        if layer is not None:
            spans.setdefault(layer, [position, position])[1] = position
    n_layer = config.n_layer

    def owner(position):
        if layer_at[position] is not None:
            return layer_at[position]
        for layer in range(1, n_layer):  # between the end of block layer - 1 and the start of block layer
            if layer in spans and layer - 1 in spans and spans[layer - 1][1] < position < spans[layer][0]:
                return layer
        return None

    position_of = {node: i for i, node in enumerate(nodes)}
    output = next(node for node in nodes if node.op == "output")
    # a parameter (or a view of one) handed to the backward is counted with the parameters already
    seen = {id(node.meta["val"].untyped_storage()) for node in nodes
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)}
    layers, rest = [[0, 0] for _ in range(n_layer)], [0, 0]
    for node in output.args[0]:
        value = node.meta.get("val") if hasattr(node, "meta") else None
        if not isinstance(value, torch.Tensor) or id(value.untyped_storage()) in seen:
            continue
        seen.add(id(value.untyped_storage()))
        nbytes = value.untyped_storage().nbytes()
        layer = owner(position_of[node])
        per_row = node in per_row_nodes
        (rest if layer is None else layers[layer])[per_row] += nbytes / batch if per_row else nbytes
    rest[1] += 2 * spec.seq_len * 8  # the batch itself: two (b, T) int64 tensors
    return Activations([tuple(x) for x in layers], tuple(rest), (0, 0), (0, 0))


def module_layer(node):
    """The block index of a graph node from its module path (transformer.h.3..., value_embeds.3), else None."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        found = re.search(r"transformer\.h\W+(\d+)|value_embeds\W+(\d+)", str(path))
        if found:
            return int(found.group(1) or found.group(2))
    return None


# -----------------------------------------------------------------------------
# A profile per spec, and the prediction at any device batch


@dataclass
class StepMemory:
    """One step's predicted memory at one device batch, in bytes."""
    device_batch: int
    parameters: int
    optimizer_state: int
    gradients: int
    activations: int  # kept by the forward for the backward (and the batch)
    extra: int  # on top of those at the forward and backward's peak
    peak: int
    phase: str  # where the peak falls: "forward and backward", "end of the backward" or "optimizer step"


@dataclass
class StepProfile:
    """What a spec's step needs, as numbers: static bytes, and per-layer activation lines in the device batch."""
    spec: StepSpec
    parameters: int
    optimizer_state: int
    gradients: int
    optimizer_peak: int
    kept_fixed: float  # what the whole model's forward keeps, fixed + per_row * b
    kept_per_row: float
    extra_fixed: float
    extra_per_row: float
    tail_fixed: float  # eager: the backward's end beyond the state and the gradients
    tail_per_row: float
    traced_seconds: float

    def at(self, device_batch):
        before = self.parameters + self.optimizer_state
        kept = int(self.kept_fixed + self.kept_per_row * device_batch)
        extra = int(max(0.0, self.extra_fixed + self.extra_per_row * device_batch))
        tail = before + self.gradients + int(max(0.0, self.tail_fixed + self.tail_per_row * device_batch))
        candidates = [(before + kept + extra, "forward and backward"), (tail, "end of the backward"),
                      (self.optimizer_peak, "optimizer step")]
        peak, phase = max(candidates, key=lambda c: c[0])
        return StepMemory(device_batch, self.parameters, self.optimizer_state, self.gradients, kept, extra, peak, phase)


def trace_profile(spec, whole=False):
    """Trace spec's step: a few seconds, most of it in Dynamo and AOT autograd for a compiled step. whole=True traces
    every layer (what the few traced layers stand for, to check them against)."""
    started = time.time()
    config = spec.model_config()
    static = trace_static(spec)
    kinds = layer_kinds(config)
    traced = None if whole else reduced_layers(kinds)
    small = config if traced is None else reduced_config(config, traced)
    if spec.compiled:
        acts = trace_compiled_activations(small, spec)
        # On top of the kept tensors, measured rather than traced (inductor decides it in code generation; dev/LOG.md):
        # on a CPU the backward first writes the logits' gradient in fp32 beside everything kept; CUDA's not
        on_top = [(0, 4 * spec.seq_len * spec.vocab_size)] if spec.device_type == "cpu" else []
        if spec.checkpoint_activations:  # a block's activations alive again while its backward recomputes them:
            # the largest layer's, as the same step without checkpointing keeps them
            on_top += trace_compiled_activations(small, replace(spec, checkpoint_activations=False)).layers
        acts.extra = max(on_top, key=lambda line: (line[1], line[0]), default=(0, 0))
    else:
        acts = trace_eager_activations(small, spec)
    # the whole model's layers: its first is the traced first; every other counts as the traced layer of its kind
    if traced is None:
        layer_lines = acts.layers
    else:
        first_of_kind = {kind: 1 + i for i, kind in enumerate(dict.fromkeys(kinds[1:]))}
        layer_lines = [acts.layers[0]] + [acts.layers[first_of_kind[kind]] for kind in kinds[1:]]
    kept_fixed = acts.rest[0] + sum(f for f, _ in layer_lines)
    kept_per_row = acts.rest[1] + sum(p for _, p in layer_lines)
    return StepProfile(spec, *static, kept_fixed, kept_per_row, *acts.extra, *acts.tail, time.time() - started)


def cache_key(spec):
    """Everything a profile depends on: the spec, torch's version, and the sources that decide the step's memory."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digest = hashlib.sha256()
    for path in TRACED_SOURCES:
        with open(os.path.join(root, path), "rb") as f:
            digest.update(f.read())
    return json.dumps({**asdict(spec), "torch": torch.__version__, "sources": digest.hexdigest()[:16]}, sort_keys=True)


@functools.lru_cache(maxsize=None)
def step_profile(spec):
    """spec's profile: from the base dir's record of earlier traces when it holds one under the same code, else
    traced now and added to it."""
    key = cache_key(spec)
    path = os.path.join(get_base_dir(), CACHE_FILE)
    record = read_json_object(path) or {}
    if key in record:
        try:
            return StepProfile(spec=spec, **{k: v for k, v in record[key].items() if k != "spec"})
        except TypeError:
            pass  # written by another version of this file: trace again
    profile = trace_profile(spec)
    record = read_json_object(path) or {}
    record[key] = {k: v for k, v in asdict(profile).items() if k != "spec"}
    try:
        atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    except OSError:
        pass  # a read-only base dir: the profile is traced again next time
    return profile


def predict(spec, device_batch):
    """spec's step at this device batch: a StepMemory."""
    return step_profile(spec).at(device_batch)


# -----------------------------------------------------------------------------
# Fitting a step into the memory there is


@dataclass
class Fit:
    device_batch: int
    checkpoint_activations: bool
    memory: StepMemory


def fits(memory, limit):
    return memory.peak <= MEMORY_SHARE * limit


def fit_step(spec, limit, rows_per_step, largest=None, checkpoint=None):
    """The largest device batch dividing the rows a step takes (at most `largest`) whose predicted peak is within
    MEMORY_SHARE of `limit` bytes: without activation checkpointing where one row fits so, else with it (checkpoint
    None: that choice; True / False: only that way). None when not even one row fits."""
    choices = [False, True] if checkpoint is None else [bool(checkpoint)]
    batches = [b for b in range(min(largest or rows_per_step, rows_per_step), 0, -1) if rows_per_step % b == 0]
    for checkpointed in choices:
        this = replace(spec, checkpoint_activations=checkpointed)
        for b in batches:  # the peak grows with the batch: the first that fits is the largest
            memory = predict(this, b)
            if fits(memory, limit):
                return Fit(b, checkpointed, memory)
    return None


def least_memory(spec, checkpoint=None):
    """The least memory (bytes) in which spec's step fits at one row: its predicted peak over MEMORY_SHARE."""
    choices = [False, True] if checkpoint is None else [bool(checkpoint)]
    peak = min(predict(replace(spec, checkpoint_activations=c), 1).peak for c in choices)
    return math.ceil(peak / MEMORY_SHARE)


def describe_fit(memory, checkpointed, limit, label=""):
    """One line: a step's predicted peak (a StepMemory) beside the memory it must fit in."""
    return (f"memory | device batch {memory.device_batch}, activation checkpointing {'on' if checkpointed else 'off'}: "
            f"predicted peak {format_bytes(memory.peak)} ({memory.phase}: parameters {format_bytes(memory.parameters)}, "
            f"optimizer state {format_bytes(memory.optimizer_state)}, gradients {format_bytes(memory.gradients)}, "
            f"activations {format_bytes(memory.activations + memory.extra)}) of {label or format_bytes(limit)} "
            f"(planned within {MEMORY_SHARE * 100:.0f} %)")


# -----------------------------------------------------------------------------
# The memory a run has


def device_memory_limit(device, given=None, given_label=""):
    """(bytes, the same in words) a step on `device` must fit in, or (None, "") where nothing says: on CUDA the card's
    free memory, or `given` bytes (named `given_label`) where less, the process then capped to it so that a bigger card
    runs as the one planned for; elsewhere (a CPU) `given`, planned for but not enforced."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        if given is None or given >= free:
            return free, f"the {format_bytes(free)} free of {name} ({format_bytes(total)})"
        torch.cuda.set_per_process_memory_fraction(given / total, device)
        return given, f"{given_label} on {name} ({format_bytes(total)}, the process capped to it)"
    return (None, "") if given is None else (given, given_label)
