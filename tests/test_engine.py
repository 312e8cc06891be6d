"""Tests for inference (nanochat/engine.py): Engine.generate / generate_batch, sampling, the calculator tool, streaming."""

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from nanochat.engine import Engine, StreamDecoder, use_calculator
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


@pytest.mark.quick
def test_a_model_with_the_reference_forward_signature_generates(tokenizer):
    """The engine's contract is forward(ids, kv_cache=rows): a model without our logits_at (a user's own class, a
    mock, the reference's signature) gives every position's logits and still generates, the same tokens as with it."""
    script, filler, choose = tool_script(tokenizer, "2+3")

    class ReferenceProtocolModel(ScriptedModel):
        def forward(self, ids, kv_cache=None):  # no logits_at: the reference project's signature
            return super().forward(ids, kv_cache=kv_cache)

    prompt = [tokenizer.get_bos_token_id()]
    ours = Engine(ScriptedModel(tokenizer.get_vocab_size(), choose), tokenizer).generate_batch(prompt, max_tokens=20)
    theirs = Engine(ReferenceProtocolModel(tokenizer.get_vocab_size(), choose), tokenizer).generate_batch(
        prompt, max_tokens=20)
    assert theirs == ours and ours[0][0][1:len(script) + 1] == script
