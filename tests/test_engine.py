"""Tests for inference (nanochat/engine.py): Engine.generate / generate_batch, sampling, the calculator tool, streaming."""

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.engine import Engine, KVCache, StreamDecoder, use_calculator
from nanochat.gpt import GPTConfig, build_model
from nanochat.tokenizer import RustBPETokenizer
from scripts import bench

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CONTEXT = 32


@pytest.fixture(scope="module")
def tokenizer():
    lines = ["The quick brown fox jumps over the lazy dog. What is 12*3? It is 36.",
             "How many r letters are in strawberry? Count them: 'strawberry'.count('r') gives 3.",
             "Numbers like 1024, 256 and 0.5 show up in sums such as 7 + 8 = 15 and 9 * 9 = 81."]
    texts = [f"{line} ({i})" for i in range(100) for line in lines]
    return RustBPETokenizer.train_from_iterator(iter(texts), 300)


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny real GPT (grouped-query attention) with random weights everywhere, so its predictions vary with context."""
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=CONTEXT, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = build_model(config, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0 if p is model.transformer.wte.weight else p.shape[1] ** -0.5)
    return model


def terminals(tokenizer):
    return {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}


def naive_greedy(model, tokenizer, prompt, max_tokens):
    """Greedy decoding the slow, obviously right way: the whole sequence through the model for every new token."""
    ids, generated = list(prompt), []
    while len(generated) < max_tokens and len(ids) < model.config.sequence_len:
        with torch.no_grad():
            next_id = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(next_id)
        generated.append(next_id)
        if next_id in terminals(tokenizer):
            break
    return generated


def columns_of(engine, prompt, **kwargs):
    steps = list(engine.generate(prompt, **kwargs))
    return [column for column, _ in steps], [masks for _, masks in steps]


# -----------------------------------------------------------------------------
# Greedy decoding, the context limit


@pytest.mark.quick
def test_greedy_equals_full_recompute_and_stops_at_the_context(model, tokenizer):
    engine = Engine(model, tokenizer)
    bos = tokenizer.get_bos_token_id()
    prompts = [[bos], tokenizer.encode("The quick brown", prepend=bos), tokenizer.encode("How many r letters are", prepend=bos)]
    for prompt in prompts:
        columns, _ = columns_of(engine, prompt, max_tokens=12, temperature=0)
        assert [c[0] for c in columns] == naive_greedy(model, tokenizer, prompt, 12)

    # A prompt 4 tokens short of the context: with no max_tokens, generation stops cleanly when it is full.
    long_prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. What is 12*3? It is 36.", prepend=bos)
    long_prompt = long_prompt[:CONTEXT - 4]
    assert len(long_prompt) == CONTEXT - 4
    expected = naive_greedy(model, tokenizer, long_prompt, 100)
    assert len(expected) == 4 and not set(expected) & terminals(tokenizer)  # this prompt really runs into the limit
    columns, _ = columns_of(engine, long_prompt, num_samples=3, temperature=0)
    assert columns == [[t, t, t] for t in expected]
    results, _ = engine.generate_batch(long_prompt, max_tokens=1000, temperature=0)
    assert results == [long_prompt + expected] and len(results[0]) == CONTEXT

    # A prompt that fills the context generates nothing; a longer one is refused with a clear message.
    assert list(engine.generate(list(range(1, CONTEXT + 1)))) == []
    with pytest.raises(ValueError, match="longer than the model's context"):
        next(engine.generate(list(range(1, CONTEXT + 2))))


@pytest.mark.quick
def test_greedy_samples_write_what_the_loop_they_replaced_wrote(model, tokenizer):
    """recipe.greedy_samples (base_train's and base_loss's look at a model) decodes on the engine: the same
    text as the loop it replaced, which fed the whole sequence for every token and stopped at <|bos|>."""
    from nanochat.recipe import greedy_samples

    bos = tokenizer.get_bos_token_id()

    def replaced_loop(prompt, max_tokens):
        ids = tokenizer.encode(prompt, prepend=bos)
        for _ in range(max_tokens):
            with torch.no_grad():
                next_id = int(model(torch.tensor([ids[-CONTEXT:]]))[0, -1].argmax())
            if next_id == bos:
                break
            ids.append(next_id)
        return tokenizer.decode(ids[1:])

    prompts = ["The quick brown", "How many r letters are", "Numbers like 1024", "What is 12*3?"]
    expected = [replaced_loop(prompt, 12) for prompt in prompts]
    assert greedy_samples(model, tokenizer, prompts, max_tokens=12) == expected


# -----------------------------------------------------------------------------
# Sampling


@pytest.mark.quick
def test_samples_of_one_prompt_differ_from_the_first_token(model, tokenizer):
    engine = Engine(model, tokenizer)
    prompt = tokenizer.encode("The quick", prepend=tokenizer.get_bos_token_id())
    results, masks = engine.generate_batch(prompt, num_samples=16, max_tokens=6, temperature=1.0)
    assert len(results) == 16
    assert len({tuple(r) for r in results}) > 1
    first_tokens = columns_of(engine, prompt, num_samples=16, max_tokens=1, temperature=1.0)[0][0]  # terminals too
    assert len(set(first_tokens)) > 1  # each row draws its own first token from the prefill logits
    for result, mask in zip(results, masks):
        assert len(mask) == len(result)
        assert mask == [0] * len(prompt) + [1] * (len(result) - len(prompt))


@pytest.mark.quick
def test_seed_makes_a_call_reproducible_and_ignores_the_global_rng(model, tokenizer):
    engine = Engine(model, tokenizer)
    prompt = tokenizer.encode("What is", prepend=tokenizer.get_bos_token_id())
    torch.manual_seed(1)
    global_state = torch.get_rng_state()
    first, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=10, seed=7)
    assert torch.equal(torch.get_rng_state(), global_state)  # the engine draws from its own generator
    torch.manual_seed(12345)
    torch.rand(3)
    again, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=10, seed=7)
    other, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=10, seed=8)
    assert again == first
    assert other != first


@pytest.mark.quick
def test_top_k_one_and_tiny_top_p_are_greedy(model, tokenizer):
    engine = Engine(model, tokenizer)
    prompt = tokenizer.encode("Numbers like", prepend=tokenizer.get_bos_token_id())
    greedy, greedy_masks = columns_of(engine, prompt, max_tokens=10, temperature=0)
    top_k_one, top_k_masks = columns_of(engine, prompt, max_tokens=10, temperature=1.5, top_k=1, seed=3)
    tiny_top_p, top_p_masks = columns_of(engine, prompt, max_tokens=10, temperature=1.5, top_p=1e-6, seed=4)
    unrestricted, _ = columns_of(engine, prompt, max_tokens=10, temperature=1.5, seed=3)
    assert top_k_one == greedy
    assert tiny_top_p == greedy
    assert unrestricted != greedy  # so the two equalities above are not a property of this model
    assert greedy_masks == top_k_masks == top_p_masks == [[1]] * 10


@pytest.mark.quick
def test_bad_arguments_are_refused(model, tokenizer):
    engine = Engine(model, tokenizer)
    for kwargs in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(num_samples=0), dict(max_tokens=-1)):
        with pytest.raises(ValueError):
            next(engine.generate([tokenizer.get_bos_token_id()], **kwargs))
    with pytest.raises(ValueError):
        next(engine.generate([]))


# -----------------------------------------------------------------------------
# The engine with scripted stub models: tool use, finished rows


class ScriptedModel(nn.Module):
    """
    Follows the model's cache protocol (rows of the batching engine's cache) and records every token fed to each row.
    Its next token is choose(history, prompt_len) for each row: a token id, or a list of ids to pick from uniformly.
    """

    def __init__(self, vocab_size, choose, sequence_len=64):
        super().__init__()
        self.config = SimpleNamespace(n_layer=1, n_head=1, n_kv_head=1, n_embd=2, sequence_len=sequence_len)
        self.vocab_size, self.choose = vocab_size, choose
        self.history, self.prompt = {}, []

    def get_device(self):
        return torch.device("cpu")

    def forward(self, ids, kv_cache=None, logits_at=None):
        rows, histories = ids.tolist(), []
        for i, (row, length) in enumerate(zip(kv_cache.indices, kv_cache.lengths)):
            if kv_cache.new_lengths is not None:  # a prompt's prefill (one prompt at a time here)
                self.prompt = rows[i][:kv_cache.new_lengths[i]]
                self.history = {row: list(self.prompt)}
            elif length > 0:  # a decode step; a sample that copied the prompt's row starts from the prompt
                self.history.setdefault(row, list(self.prompt)).extend(rows[i])
            histories.append(self.history.get(row) if length > 0 or kv_cache.new_lengths else None)  # None: padding
        kv_cache.advance(ids.size(1))
        logits = torch.full((len(rows), 1 if logits_at is not None else ids.size(1), self.vocab_size), -100.0)
        for i, history in enumerate(histories):  # the next token's logits at the last position (what is asked)
            if history is not None:
                choice = self.choose(history, len(self.prompt))
                logits[i, -1, choice if isinstance(choice, list) else [choice]] = 0.0
        return logits


def tool_script(tokenizer, expression):
    """A model that writes <|python_start|>expression<|python_end|>, then 'z' until it has seen <|output_end|>, then stops."""
    special = tokenizer.encode_special
    script = [special("<|python_start|>"), *tokenizer.encode(expression), special("<|python_end|>")]
    filler = tokenizer.encode("z")[0]

    def choose(history, prompt_len):
        if special("<|output_end|>") in history[prompt_len:]:
            return special("<|assistant_end|>")
        generated = len(history) - prompt_len
        return script[generated] if generated < len(script) else filler

    return script, filler, choose


@pytest.mark.quick
def test_calculator_output_is_forced_with_mask_zero(tokenizer):
    special = tokenizer.encode_special
    script, _, choose = tool_script(tokenizer, "12*3")
    model = ScriptedModel(tokenizer.get_vocab_size(), choose)
    engine = Engine(model, tokenizer)
    prompt = tokenizer.encode("What is 12*3?", prepend=tokenizer.get_bos_token_id())
    forced = [special("<|output_start|>"), *tokenizer.encode("36"), special("<|output_end|>")]
    end = special("<|assistant_end|>")

    columns, masks = columns_of(engine, prompt, num_samples=2, max_tokens=40)
    assert columns == [[t, t] for t in script + forced + [end]]
    assert masks == [[m, m] for m in [1] * len(script) + [0] * len(forced) + [1]]
    assert model.history[0][len(prompt):] == script + forced  # the forced tokens went through the model too

    results, result_masks = engine.generate_batch(prompt, num_samples=2, max_tokens=40)
    assert results == [prompt + script + forced] * 2
    assert result_masks == [[0] * len(prompt) + [1] * len(script) + [0] * len(forced)] * 2


@pytest.mark.quick
def test_a_refused_tool_call_forces_nothing(tokenizer):
    script, filler, choose = tool_script(tokenizer, "__import__('os')")
    engine = Engine(ScriptedModel(tokenizer.get_vocab_size(), choose), tokenizer)
    prompt = [tokenizer.get_bos_token_id()]
    results, masks = engine.generate_batch(prompt, max_tokens=len(script) + 3)
    assert results == [prompt + script + [filler] * 3]
    assert masks == [[0] + [1] * (len(script) + 3)]


@pytest.mark.quick
def test_finished_rows_repeat_their_terminal_with_mask_zero(tokenizer):
    end = tokenizer.encode_special("<|assistant_end|>")
    short, long, filler = tokenizer.encode("a")[0], tokenizer.encode("b")[0], tokenizer.encode("z")[0]

    def choose(history, prompt_len):
        generated = history[prompt_len:]
        if not generated:
            return [short, long]  # a coin flip per row
        if generated[0] == short or len(generated) == 4:
            return end
        return filler

    engine = Engine(ScriptedModel(tokenizer.get_vocab_size(), choose), tokenizer)
    prompt = [tokenizer.get_bos_token_id()]
    columns, masks = columns_of(engine, prompt, num_samples=16, max_tokens=20, seed=0)
    rows = list(zip(*columns))
    row_masks = list(zip(*masks))
    assert {row[0] for row in rows} == {short, long}
    assert len(columns) == 5  # generation ends once every row has stopped
    for row, row_mask in zip(rows, row_masks):
        if row[0] == short:
            assert row == (short, end, end, end, end) and row_mask == (1, 1, 0, 0, 0)
        else:
            assert row == (long, filler, filler, filler, end) and row_mask == (1, 1, 1, 1, 1)

    results, result_masks = engine.generate_batch(prompt, num_samples=16, max_tokens=20, seed=0)
    for result, mask in zip(results, result_masks):
        assert result in (prompt + [short], prompt + [long, filler, filler, filler])  # terminal excluded
        assert mask == [0] + [1] * (len(result) - 1)


# -----------------------------------------------------------------------------
# Calculator


@pytest.mark.quick
@pytest.mark.parametrize("expression, answer", [
    ("12*3", "36"), ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("-5 + 2", "-3"), ("7 / 2", "3.5"), ("6 / 3", "2"),
    ("7 // 2", "3"), ("7 % 3", "1"), ("2 ** 10", "1024"), ("-(4 - 10)", "6"), ("0.1 + 0.2", "0.3"), ("2.5 * 4", "10"),
    ("1234567 * 7654321", "9449772114007"), ("2 ** 100", "1267650600228229401496703205376"),
    ("'strawberry'.count('r')", "3"), ("'banana'.count('an') + 1", "3"),
])
def test_calculator_answers(expression, answer):
    assert use_calculator(expression) == answer


@pytest.mark.quick
@pytest.mark.parametrize("expression", [
    "__import__('os')", "__import__('os').system('touch pwned')", "().__class__", "'a'.upper()", "open('x', 'w')",
    "9**9**9", "10**100000", "2 ** 101", "1.0001 ** 1000", "2**1000000 - 1", "(10**500)**3", "x", "x + 1", "lambda: 1", "[i for i in range(9)]",
    "1 / 0", "5 % 0", "'abc'", "'a' * 3", "'abc'.count(x)", "len('abc')", "1e308 * 10", "(-8) ** 0.5", "1 if 1 else 2",
    "import os", "", "1 +", "(" * 500 + "1" + ")" * 500, "+".join(["1"] * 5000),
])
def test_calculator_refuses_quickly_and_without_side_effects(expression, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert use_calculator(expression) is None
    assert time.perf_counter() - start < 0.5
    assert os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------
# Streaming


@pytest.mark.quick
def test_stream_decoder_never_splits_a_character(tokenizer):
    text = "Héllo wörld: ☃, 日本語 and 🙂!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # the tiny ASCII tokenizer spells these characters byte by byte
    stream = StreamDecoder(tokenizer)
    pieces = [stream.push(token) for token in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(1 for piece in pieces if piece) > 5  # it streams, rather than holding everything to the end


# -----------------------------------------------------------------------------
# The benchmark (scripts/bench.py engine) on tiny settings: it runs and reports; speeds are for BENCHMARKS.md


@pytest.mark.quick
def test_bench_engine_runs_and_ends_with_its_json_line(tiny_env, capsys):
    bench.main(["engine", "--depth=1", "--seq-len=64", "--prompt-tokens=8", "--new-tokens=8", "--batch=2", "--repeats=1",
                "--cached-lengths", "8", "16", "--length-steps=2", "--device-type=cpu"])
    out = capsys.readouterr().out
    assert "decode, batch 2" in out and "naive full recompute" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "engine"
    assert result["same_tokens"] is True  # the engine's greedy tokens are the naive loop's
    config = result["model_config"]  # base_train's default components, as a user's model has them
    assert config["value_embeds"] and config["smear"] and config["residual_scalars"], config
    assert result["prefill_tok_per_s"] > 0 and result["speedup_vs_naive"] > 0
    assert set(result["decode"]) == {"1", "2"} and result["decode"]["2"]["tok_per_s"] > 0
    assert set(result["step_ms_by_cached_length"]) == {"8", "16"}


# -----------------------------------------------------------------------------
# karpathy/nanochat's cache protocol: KVCache, and a model that reads and advances it itself


class ReferenceCacheModel(nn.Module):
    """
    A tiny transformer that uses the cache the way karpathy/nanochat's gpt.py does: forward(idx, targets=None,
    kv_cache=None, loss_reduction="mean") with no logits_at; each layer writes its (B, T, H, D) keys and values into
    get_layer_cache(i) at cache_seqlens and attends to everything up to there; the last layer calls advance(T); the
    last token's embedding goes to prev_embedding for smear. Positions come from a learned table, so a wrong cache
    position changes the logits.
    """

    def __init__(self, vocab_size, sequence_len=CONTEXT, n_layer=2, n_head=2, head_dim=8):
        super().__init__()
        n_embd = n_head * head_dim
        self.config = SimpleNamespace(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                                      n_kv_head=n_head, n_embd=n_embd)
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(sequence_len, n_embd)
        self.qkv = nn.ModuleList(nn.Linear(n_embd, 3 * n_embd, bias=False) for _ in range(n_layer))
        self.proj = nn.ModuleList(nn.Linear(n_embd, n_embd, bias=False) for _ in range(n_layer))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * (1.0 if p.ndim == 2 and p.shape[1] > n_embd else 0.5))

    def get_device(self):
        return self.wte.weight.device

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        B, T = idx.shape
        H = self.config.n_head
        start = 0 if kv_cache is None else kv_cache.get_pos()
        x = self.wte(idx)
        previous = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)  # smear: the token before each one
        if kv_cache is not None:
            if kv_cache.prev_embedding is not None:
                previous[:, :1] = kv_cache.prev_embedding
            kv_cache.prev_embedding = x[:, -1:]
        x = x + 0.5 * previous + self.wpe(torch.arange(start, start + T))
        for i in range(self.config.n_layer):
            q, k, v = self.qkv[i](x).view(B, T, 3, H, -1).unbind(2)  # (B, T, H, D): the cache's layout
            if kv_cache is None:
                y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            else:
                k_cache, v_cache = kv_cache.get_layer_cache(i)
                pos = int(kv_cache.cache_seqlens[0])
                k_cache[:, pos:pos + T], v_cache[:, pos:pos + T] = k, v
                visible = torch.arange(pos + T)[None, :] <= torch.arange(pos, pos + T)[:, None]
                y = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :pos + T].transpose(1, 2),
                                                   v_cache[:, :pos + T].transpose(1, 2), attn_mask=visible)
                if i == kv_cache.n_layers - 1:
                    kv_cache.advance(T)
            x = x + self.proj[i](y.transpose(1, 2).reshape(B, T, -1))
        return self.lm_head(x).float()


@pytest.mark.quick
def test_kv_cache_has_the_reference_interface():
    cache = KVCache(batch_size=1, num_heads=2, seq_len=8, head_dim=4, num_layers=3, device="cpu", dtype=torch.float32)
    assert cache.k_cache.shape == cache.v_cache.shape == (3, 1, 8, 2, 4)
    k, v = cache.get_layer_cache(1)
    k[0, :5] = 1.0  # a layer's cache is a view: what the model writes there is the cache
    v[0, :5] = 2.0
    cache.prev_embedding = torch.full((1, 1, 6), 3.0)
    assert cache.get_pos() == 0
    cache.advance(5)
    assert cache.get_pos() == 5 and cache.cache_seqlens.tolist() == [5]
    with pytest.raises(ValueError, match="overflows"):
        cache.advance(4)

    decode = KVCache(batch_size=3, num_heads=2, seq_len=10, head_dim=4, num_layers=3, device="cpu", dtype=torch.float32)
    decode.prefill(cache)  # a batch-1 prompt to every row
    assert decode.get_pos() == 5 and decode.cache_seqlens.tolist() == [5, 5, 5]
    assert (decode.k_cache[1, :, :5] == 1.0).all() and (decode.v_cache[1, :, :5] == 2.0).all()
    assert (decode.k_cache[1, :, 5:] == 0.0).all() and (decode.k_cache[0] == 0.0).all()
    assert decode.prev_embedding.shape == (3, 1, 6) and (decode.prev_embedding == 3.0).all()
    with pytest.raises(ValueError, match="not empty"):
        decode.prefill(cache)
    decode.reset()
    assert decode.get_pos() == 0 and decode.prev_embedding is None
    with pytest.raises(ValueError, match="layers"):
        decode.prefill(KVCache(1, 2, 8, 4, 2, "cpu", torch.float32))


@pytest.mark.quick
def test_a_reference_protocol_model_prefills_decodes_and_generates(tokenizer):
    model = ReferenceCacheModel(tokenizer.get_vocab_size()).eval()
    bos = tokenizer.get_bos_token_id()
    prompt = tokenizer.encode("The quick brown", prepend=bos)

    # by hand, as code written against the reference does it: a batch-1 prefill, copied to 2 rows, decoded
    with torch.no_grad():
        full = model(torch.tensor([prompt + [7, 9]]))
        prompt_cache = KVCache(1, 2, len(prompt), 8, 2, "cpu", torch.float32)
        prefill_logits = model(torch.tensor([prompt]), kv_cache=prompt_cache)
        cache = KVCache(2, 2, len(prompt) + 2, 8, 2, "cpu", torch.float32)
        cache.prefill(prompt_cache)
        step1 = model(torch.tensor([[7], [7]]), kv_cache=cache)
        step2 = model(torch.tensor([[9], [9]]), kv_cache=cache)
    assert prompt_cache.get_pos() == len(prompt) and cache.get_pos() == len(prompt) + 2
    close = dict(rtol=1e-4, atol=1e-3)  # logits of size ~10 summed in other orders
    torch.testing.assert_close(prefill_logits[0], full[0, :len(prompt)], **close)
    for row in range(2):
        torch.testing.assert_close(step1[row, -1], full[0, len(prompt)], **close)
        torch.testing.assert_close(step2[row, -1], full[0, len(prompt) + 1], **close)

    # Engine: greedy is the full recompute's, every sample alike, up to the context
    engine = Engine(model, tokenizer)
    for start in ([bos], prompt):
        columns, masks = columns_of(engine, start, num_samples=3, max_tokens=12, temperature=0)
        assert [c[0] for c in columns] == naive_greedy(model, tokenizer, start, 12)
        assert all(len(set(c)) == 1 for c in columns) and all(m == [1, 1, 1] for m in masks)
    long_prompt = (prompt * CONTEXT)[:CONTEXT - 3]
    results, masks = engine.generate_batch(long_prompt, max_tokens=100, temperature=0)
    expected = naive_greedy(model, tokenizer, long_prompt, 100)
    assert len(expected) == 3 and not set(expected) & terminals(tokenizer)  # it runs into the context
    assert results == [long_prompt + expected] and masks == [[0] * len(long_prompt) + [1] * 3]

    # sampling: each row its own draw, reproducible with the seed, another seed another draw
    first, first_masks = engine.generate_batch(prompt, num_samples=8, max_tokens=6, temperature=1.0, seed=3)
    assert engine.generate_batch(prompt, num_samples=8, max_tokens=6, temperature=1.0, seed=3) == (first, first_masks)
    assert engine.generate_batch(prompt, num_samples=8, max_tokens=6, temperature=1.0, seed=4)[0] != first
    assert len({tuple(r) for r in first}) > 1
    for result, mask in zip(first, first_masks):
        assert result[:len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (len(result) - len(prompt))


class ScriptedReferenceModel(ScriptedModel):
    """ScriptedModel's choices on karpathy/nanochat's protocol: one position for the batch, which forward advances."""

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        if kv_cache.get_pos() == 0:  # the prompt's prefill, one row
            self.prompt, self.history = idx[0].tolist(), {}
        else:
            for row, token in enumerate(idx[:, -1].tolist()):
                self.history.setdefault(row, list(self.prompt)).append(token)
        kv_cache.advance(idx.size(1))
        logits = torch.full((idx.size(0), idx.size(1), self.vocab_size), -100.0)
        for row in range(idx.size(0)):
            choice = self.choose(self.history.get(row, self.prompt), len(self.prompt))
            logits[row, -1, choice if isinstance(choice, list) else [choice]] = 0.0
        return logits


@pytest.mark.quick
def test_a_reference_protocol_model_gets_the_tools_and_samples_of_ours(tokenizer):
    """The calculator's forced tokens (mask 0), stopped rows and each row's draws are the same on the reference's
    KVCache as on our rows, for the same choices."""
    script, _, tool_choose = tool_script(tokenizer, "2+3")
    end, heads, tails = tokenizer.encode_special("<|assistant_end|>"), tokenizer.encode("a")[0], tokenizer.encode("b")[0]

    def coin_choose(history, prompt_len):  # a coin flip per row, then heads stops at once and tails after 3 more
        generated = history[prompt_len:]
        return [heads, tails] if not generated else end if generated[0] == heads or len(generated) == 4 else tails

    prompt = [tokenizer.get_bos_token_id()]
    for choose, num_samples in ((tool_choose, 2), (coin_choose, 12)):
        ours = Engine(ScriptedModel(tokenizer.get_vocab_size(), choose), tokenizer)
        theirs = Engine(ScriptedReferenceModel(tokenizer.get_vocab_size(), choose), tokenizer)
        kwargs = dict(num_samples=num_samples, max_tokens=20, seed=5)
        assert columns_of(theirs, prompt, **kwargs) == columns_of(ours, prompt, **kwargs)
        assert theirs.generate_batch(prompt, **kwargs) == ours.generate_batch(prompt, **kwargs)
    results, masks = theirs.generate_batch(prompt, num_samples=12, max_tokens=20, seed=5)
    assert {tuple(r) for r in results} == {(prompt[0], heads), (prompt[0], tails, tails, tails, tails)}
    results, masks = Engine(ScriptedReferenceModel(tokenizer.get_vocab_size(), tool_choose), tokenizer).generate_batch(
        prompt, max_tokens=20)
    forced = [tokenizer.encode_special("<|output_start|>"), *tokenizer.encode("5"), tokenizer.encode_special("<|output_end|>")]
    assert results[0][1:len(script) + len(forced) + 1] == script + forced
    assert masks[0][1:len(script) + len(forced) + 1] == [1] * len(script) + [0] * len(forced)
