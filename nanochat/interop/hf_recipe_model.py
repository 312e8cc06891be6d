"""
The modeling code an export ships (as modeling_nanochat_recipe.py, under config.json's auto_map, loaded with
trust_remote_code=True) when its model has a recipe component transformers' NanoChat has no place for. It imports only
torch and transformers, keeps our parameter names and writes out nanochat.gpt's plain-path math. No KV cache:
generate() feeds the whole sequence every step (use_cache is off).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class NanoChatRecipeConfig(PretrainedConfig):
    model_type = "nanochat_recipe"

    def __init__(self, vocab_size=32768, hidden_size=768, num_hidden_layers=12, num_attention_heads=6,
                 num_key_value_heads=6, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                 final_logit_softcapping=15.0, gate_channels=32, value_embeds=False, residual_scalars=False,
                 smear=False, backout=False, value_embed_layers=None, attention_windows=None, rotary_bf16=False,
                 qk_scale=1.0, ve_gate_channels=None, ve_gate_scale=2.0, smear_gate_channels=None, backout_layer=None,
                 **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.max_position_embeddings, self.rms_norm_eps, self.rope_theta = max_position_embeddings, rms_norm_eps, rope_theta
        self.final_logit_softcapping, self.gate_channels = final_logit_softcapping, gate_channels
        self.value_embeds, self.residual_scalars, self.smear, self.backout = value_embeds, residual_scalars, smear, backout
        self.value_embed_layers = list(value_embed_layers or [])  # the layers with a value embedding (if value_embeds)
        # per layer, how many positions (itself included) a query sees; 0 = all of them (nanochat's sliding_window)
        self.attention_windows = list(attention_windows or [0] * num_hidden_layers)
        # exact-math variants of an imported model (nanochat.gpt.GPTConfig): rotary tables rounded to bf16, q and k
        # scaled after their norm, the gates' width and range, and which block's output backout subtracts
        self.rotary_bf16, self.qk_scale, self.ve_gate_scale = rotary_bf16, qk_scale, ve_gate_scale
        self.ve_gate_channels = gate_channels if ve_gate_channels is None else ve_gate_channels
        self.smear_gate_channels = gate_channels if smear_gate_channels is None else smear_gate_channels
        self.backout_layer = num_hidden_layers // 2 - 1 if backout_layer is None else backout_layer
        kwargs.setdefault("use_cache", False)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def _norm(x, eps):
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def _has_value_embed(config, layer):
    return config.value_embeds and layer in config.value_embed_layers


class _Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.eps = c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps
        self.qk_scale, self.ve_gate_scale = c.qk_scale, c.ve_gate_scale
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.c_q = nn.Linear(c.hidden_size, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(c.hidden_size, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(c.hidden_size, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.window = c.attention_windows[layer]
        if _has_value_embed(c, layer):
            self.ve_gate = nn.Linear(min(c.ve_gate_channels, c.hidden_size), self.n_kv_head, bias=False)

    def forward(self, x, cos, sin, value_embed):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if value_embed is not None:
            gate = self.ve_gate_scale * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))
            v = v + gate.unsqueeze(-1) * value_embed.view(B, T, self.n_kv_head, self.head_dim)

        def rotate_then_norm(t):  # rotary on split halves, then QK-norm
            d = t.size(-1) // 2
            t1, t2 = t[..., :d], t[..., d:]
            return _norm(torch.cat((t1 * cos + t2 * sin, t2 * cos - t1 * sin), dim=-1), self.eps)

        q, k = rotate_then_norm(q) * self.qk_scale, rotate_then_norm(k) * self.qk_scale
        mask = None
        if 0 < self.window < T:  # causal within the window: query t sees keys (t - window, t]
            distance = torch.arange(T, device=x.device)[:, None] - torch.arange(T, device=x.device)[None, :]
            mask = (distance >= 0) & (distance < self.window)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class _MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.c_proj = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class _Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn, self.mlp, self.eps = _Attention(config, layer), _MLP(config), config.rms_norm_eps

    def forward(self, x, cos, sin, value_embed):
        x = x + self.attn(_norm(x, self.eps), cos, sin, value_embed)
        return x + self.mlp(_norm(x, self.eps))


class NanoChatRecipeForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanoChatRecipeConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["_Block"]

    def __init__(self, config):
        super().__init__(config)
        c = config
        kv_dim = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(c.vocab_size, c.hidden_size),
            "h": nn.ModuleList([_Block(c, i) for i in range(c.num_hidden_layers)]),
        })
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.value_embeds:
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.vocab_size, kv_dim)
                                               for i in range(c.num_hidden_layers) if _has_value_embed(c, i)})
        if c.residual_scalars:
            self.resid_lambdas = nn.Parameter(torch.ones(c.num_hidden_layers))
            self.x0_lambdas = nn.Parameter(torch.zeros(c.num_hidden_layers))
        if c.smear:
            self.smear_gate = nn.Linear(min(c.smear_gate_channels, c.hidden_size), 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if c.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this model takes unpadded rows only (no attention_mask zeros): generate one row at a time")
        c = self.config
        B, T = input_ids.shape
        head_dim = c.hidden_size // c.num_attention_heads
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, head_dim, 2, device=input_ids.device, dtype=torch.float32)
                                           / head_dim))
        angles = torch.outer(torch.arange(T, device=input_ids.device, dtype=torch.float32), inv_freq)
        dtype = self.transformer.wte.weight.dtype
        cos, sin = angles.cos(), angles.sin()
        if c.rotary_bf16:
            cos, sin = cos.bfloat16(), sin.bfloat16()
        cos, sin = cos.to(dtype)[None, :, None, :], sin.to(dtype)[None, :, None, :]

        x = _norm(self.transformer.wte(input_ids), c.rms_norm_eps)
        if c.smear:
            previous = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
            x = x + self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :self.smear_gate.in_features])) * previous
        x0, x_mid = x, None
        for i, block in enumerate(self.transformer.h):
            if c.residual_scalars:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            value_embed = self.value_embeds[str(i)](input_ids) if _has_value_embed(c, i) else None
            x = block(x, cos, sin, value_embed)
            if c.backout and i == c.backout_layer:
                x_mid = x
        if c.backout:
            x = x - self.backout_lambda * (x_mid if x_mid is not None else x0)
        x = _norm(x, c.rms_norm_eps)
        cap = c.final_logit_softcapping
        logits = self.lm_head(x).float()
        logits = logits if cap is None else cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}  # no cache: the whole sequence every step
