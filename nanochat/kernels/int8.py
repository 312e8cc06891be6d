"""
Int8 weights for inference on a CPU (chat_cli and chat_web --int8): `quantize_int8(model)` swaps every linear and
embedding table of a loaded, prepared model (GPT.prepare_for_inference) for one that stores its matrix as int8 with a
scale per output row (symmetric: absmax / 127), a quarter of fp32's bytes; norms, scalars and the rotary tables stay
as they are. Weight-only: activations stay in the decode dtype, which keeps the greedy token where int8 activations
lose it. In fp32 each matmul is torch's own on the weight dequantized for that call (torch's int8 kernel,
aten._weight_int8pack_mm, was 8-35x slower in fp32 on the EPYC); under bf16 autocast, that kernel. docs/serving.md
("On a laptop") has the measurements. Not for training or saving: the fp32 weights are gone.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import UserError

INT8_MAX = 127  # symmetric: -127..127, so that -x quantizes to -q


def quantize_rows(weight):
    """(int8 matrix, fp32 scale per row) of a 2-D weight: row r ~= q[r] * scale[r], scale = absmax(row) / 127 (a row
    of zeros gets a tiny scale, not 0/0)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).div_(INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.round(weight / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


class Int8Linear(nn.Module):
    """A bias-free nn.Linear with an int8 weight (a Parameter without grad, so num_params still counts it) and a scale
    per output feature."""

    def __init__(self, linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear replaces the model's bias-free linears only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x):
        rows = x.reshape(-1, self.in_features)
        if x.dtype in (torch.bfloat16, torch.float16):  # the kernel's fast path: bf16 (or fp16) activations
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scale.to(x.dtype))
        else:  # the scale after the matmul: one multiply per output, not one per weight
            out = F.linear(rows, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """An nn.Embedding with an int8 table and a scale per row (per token): a lookup returns the rows dequantized, in
    fp32 (GPT.forward casts the embedding to the residual stream's dtype)."""

    def __init__(self, embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        q, scale = quantize_rows(embedding.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, ids):
        return F.embedding(ids, self.weight).float() * self.scale[ids].unsqueeze(-1)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


@torch.no_grad()
def quantize_int8(model):
    """Swap every nn.Linear and nn.Embedding below `model` for its int8 version, in place, after
    GPT.prepare_for_inference: the stacked q, k, v matrices it made are dropped (each projection quantized on its own,
    so that a row's scale is its own). Refused off a CPU and for a model that still trains. Returns the model."""
    if model.get_device().type != "cpu":
        raise UserError(f"--int8 runs on a CPU; this model is on {model.get_device()} (use --device-type=cpu)")
    if model.training:
        raise UserError("int8 weights are for inference: the model must be in eval mode")
    swaps = {nn.Linear: Int8Linear, nn.Embedding: Int8Embedding}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in swaps:
                setattr(module, name, swaps[type(child)](child))
    for block in model.transformer.h:
        block.attn.inference_weight = None  # its rows live on as the int8 projections
    return model


def weight_bytes(model):
    """Bytes of the model's weights: its state dict (parameters, and buffers such as the int8 scales; not the rotary
    tables or other tables derived at load), each storage counted once (views of one matrix share it)."""
    storages = {}
    for tensor in model.state_dict().values():
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
