"""
Apple silicon: MPS refuses some ops between tensors of two floating dtypes, which the CPU and CUDA silently promote
(karpathy/nanochat#741: an fp32 tensor against bf16 parameters in the optimizer, "'mps.multiply' op requires the same
element type for all operands"; #795: bf16 queries against an fp32 KV cache in attention). No Mac runs here, so the
CPU runs what an MPS device runs (the plain model, no CPU kernels swapped in; AdamW's unfused math, since torch's
fused kernel is taken on CPUs and CUDA only; the KV cache in the compute dtype) under MixedDtypes, which raises on
every op that would mix.

Which ops count (MixedDtypes.counts): the pointwise ones (aten's `pointwise` tag: arithmetic, comparisons, lerp,
addcmul, where, ...), the _foreach_ ops (entry by entry), the matrix products, the attention's forward (queries, keys,
values, mask) and cat/stack. An op of these is mixed when its floating-point tensors with at least one dimension have
more than one dtype. Not counted:
- 0-dim tensors (the residual scalars' fp32 lambdas times the bf16 stream, forward and backward: the only ones on this
  path): torch's promotion never lets one change the dtype of a result with dimensions, and MPS's binary kernels cast
  it to the other operand's type (aten/src/ATen/native/mps/operations/BinaryOps.mm, binaryOpTensor), as the
  reference's bf16 runs on MPS multiply its resid_lambdas[i] into a bf16 stream. #741's failure was in a
  torch.compile'd optimizer, and nothing compiles on MPS here unless asked (common.compile_choice). Casting the lambdas
  would change the CPU's bf16 numbers: its backward multiplies the gradient by the fp32 scalar, unrounded.
- conversions (_to_copy, copy_): changing a dtype is what they are for; reductions; the attention's backward, whose
  fp32 logsumexp is its own output kept in fp32 by design; torch's fused AdamW, whose step counts are fp32 by contract
  (and which MPS does not take).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nanochat.engine as engine
import nanochat.optim as optim
from nanochat.common import autocast_for, get_compute_dtype
from nanochat.engine import Engine
from nanochat.gpt import GPTConfig, build_model
from nanochat.loop import lm_loss, train_step
from nanochat.recipe import OPTIMIZER_COMPONENTS, build_optimizers
from nanochat.tokenizer import RustBPETokenizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")

aten = torch.ops.aten
PRODUCTS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.addmv, aten.mv, aten.dot, aten.matmul}
COMBINED = {aten.cat, aten.stack}


class MixedDtypeError(RuntimeError):
    pass


class MixedDtypes(TorchDispatchMode):
    """Raises MixedDtypeError on any aten op that counts (module docstring) and computes with floating-point tensors of more
    than one dtype; `seen` counts the ops checked."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    @staticmethod
    def counts(func):
        name = func.overloadpacket.__name__
        return (torch.Tag.pointwise in func.tags or name.startswith("_foreach_") or func.overloadpacket in PRODUCTS
                or func.overloadpacket in COMBINED
                or (name.startswith("_scaled_dot_product") and "backward" not in name))

    @staticmethod
    def operand_groups(func, args, kwargs):
        """The tensors that meet in one computation: a _foreach_ op's i-th entries (with its non-list tensors), else
        all of them."""
        if func.overloadpacket.__name__.startswith("_foreach_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and torch.is_tensor(a[0])]
            single = [a for a in args if torch.is_tensor(a)]
            return [list(entries) + single for entries in zip(*lists)]
        return [tree_leaves((args, kwargs))]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counts(func):
            self.seen += 1
            for group in self.operand_groups(func, args, kwargs):
                dtypes = {t.dtype for t in group if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0}
                if len(dtypes) > 1:
                    raise MixedDtypeError(f"{func} mixes {sorted(str(d) for d in dtypes)}: MPS may refuse it")
        return func(*args, **kwargs)


@pytest.mark.quick
def test_the_mode_raises_on_mixed_operands_and_passes_scalars_and_conversions():
    bf16, fp32 = torch.ones(4, dtype=torch.bfloat16), torch.ones(4)
    for mixed in (lambda: bf16 + fp32, lambda: bf16.lerp(fp32, 0.5), lambda: torch.cat([bf16, fp32]),
                  lambda: torch._foreach_add([bf16, fp32], [bf16, bf16]), lambda: torch.where(fp32 > 0, bf16, fp32)):
        with pytest.raises(MixedDtypeError, match="mixes"), MixedDtypes():
            mixed()
    with MixedDtypes() as mode:
        bf16 * torch.tensor(2.0)  # a 0-dim tensor is a scalar
        bf16 + fp32.to(torch.bfloat16)  # converted first
        torch._foreach_add([bf16, fp32], [bf16, fp32])  # each entry in its own dtype
        (bf16 @ bf16.view(4, 1)).sum()
    assert mode.seen == 4


@pytest.fixture(scope="module")
def tokenizer():
    text = ["The quick brown fox jumps over the lazy dog. What is 12*3? It is 36.", "Paris is the capital of France."]
    return RustBPETokenizer.train_from_iterator(iter(text * 40), 300)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_training_and_generation_mix_no_dtypes_on_the_path_mps_runs(monkeypatch, tokenizer, dtype):
    """Two training steps of a model with every component (the loss scale's too, in fp16), both optimizers with every
    option, then an engine's prefill and decode steps of two samples on a KV cache in the compute dtype."""
    monkeypatch.setenv("NANOCHAT_DTYPE", dtype)
    monkeypatch.setattr(optim, "FUSED", False)  # AdamW's math as on MPS
    monkeypatch.setattr(engine, "kv_cache_dtype", get_compute_dtype)  # a CPU's cache is fp32 (common.kv_cache_dtype)
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=32, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2,
                       n_embd=64, value_embeds=True, residual_scalars=True, smear=True, backout=True,
                       sliding_window=True)
    model = build_model(config, "cpu")
    optimizers = build_optimizers(model, unembedding_lr=0.02, embedding_lr=0.2, matrix_lr=0.03, weight_decay=0.1,
                                  optimizer_components=OPTIMIZER_COMPONENTS)
    tokens = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    prompt = tokenizer.encode("The quick brown", prepend=tokenizer.get_bos_token_id())
    with MixedDtypes() as mode:
        for _ in range(2):
            loss = train_step(model, optimizers, [(tokens[:, :-1], tokens[:, 1:])], lm_loss, 1.0, 0.9,
                              autocast_for("cpu"))
        model.eval()
        results, _ = Engine(model, tokenizer).generate_batch(prompt, num_samples=2, max_tokens=6, temperature=1.0)
    assert loss == loss and mode.seen > 500
    assert [len(r) for r in results] == [len(prompt) + 6] * 2
    assert model.transformer.wte.weight.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
