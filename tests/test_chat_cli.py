"""
Tests for talking to a model: nanochat/serving/chat.py (validation, trimming to the context, streaming replies with tool
calls and stop strings) and scripts/chat_cli.py run as a real subprocess against a tiny random checkpoint.
build_chat_checkpoint is shared with tests/test_chat_web.py.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanochat.checkpoint_manager import checkpoint_dir, save_checkpoint
from nanochat.engine import Engine, Sampling
from nanochat.gpt import GPTConfig, build_model
from nanochat.serving.chat import (MAX_MESSAGE_CHARS, MAX_MESSAGES, MAX_TOTAL_CHARS, TERMINAL_MARKUP, Finish,
                                   MarkupWriter, Piece, RequestError, ReplyStream, fit_conversation, generate_replies,
                                   parse_markup, parts_as_markup, validate_messages)
from nanochat.serving.protocol import read_sampling
from nanochat.tokenizer import RustBPETokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_CONTEXT = 128


def build_chat_checkpoint(tiny_base_dir, base_dir, sequence_len, sources=("sft",)):
    """
    A copy of the tiny base dir with a random 2-layer GPT saved as <source>/tiny for each source. Its output layer
    gives every special token logit 0 and ordinary tokens a wide spread, so under top-k the model never ends a
    reply by itself: replies run to max_tokens, which makes lengths and timings predictable.
    Returns the tokenizer.
    """
    shutil.copytree(tiny_base_dir, base_dir)
    tokenizer = RustBPETokenizer.from_directory(os.path.join(base_dir, "tokenizer"))
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=sequence_len, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2,
                       n_kv_head=2, n_embd=64)
    model = build_model(config, "cpu")
    with torch.no_grad():
        for block in model.transformer.h:  # zero-initialised projections would make every block the identity
            block.attn.c_proj.weight.normal_(0.0, config.n_embd ** -0.5)
            block.mlp.c_proj.weight.normal_(0.0, (4 * config.n_embd) ** -0.5)
        model.lm_head.weight.normal_(0.0, 1.0)
        for name in tokenizer.get_special_tokens():
            model.lm_head.weight[tokenizer.encode_special(name)] = 0.0
    meta = {"model_config": dataclasses.asdict(config), "tokenizer_hash": tokenizer.fingerprint()}
    old = os.environ.get("NANOCHAT_BASE_DIR")
    os.environ["NANOCHAT_BASE_DIR"] = str(base_dir)
    try:
        for source in sources:
            save_checkpoint(checkpoint_dir(source, "tiny"), 1, model, [], meta)
    finally:
        if old is None:
            os.environ.pop("NANOCHAT_BASE_DIR")
        else:
            os.environ["NANOCHAT_BASE_DIR"] = old
    return tokenizer


@pytest.fixture(scope="module")
def cli_base_dir(tiny_base_dir, tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("chat_cli") / "base"
    build_chat_checkpoint(tiny_base_dir, base_dir, CLI_CONTEXT, sources=("sft", "base"))
    return str(base_dir)


def run_cli(base_dir, *args, stdin=None, timeout=60, omp_threads="1"):
    env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, OMP_NUM_THREADS=omp_threads)
    if omp_threads is None:
        del env["OMP_NUM_THREADS"]
    command = [sys.executable, "-m", "scripts.chat_cli", "--device-type", "cpu", *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=REPO_ROOT, env=env,
                          timeout=timeout, check=False)


# -----------------------------------------------------------------------------
# chat_cli as a user runs it


def test_one_shot_prompt_answers_with_the_sft_and_the_base_model(cli_base_dir):
    result = run_cli(cli_base_dir, "-p", "What is the capital of France?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert "loaded sft model 'tiny' step 1" in result.stderr and "context 128 tokens" in result.stderr
    assert result.stdout.strip(), "the reply is printed on stdout"
    assert "cut at 12 tokens" in result.stderr  # this model never ends a reply by itself

    result = run_cli(cli_base_dir, "-i", "base", "-p", "The river flows", "--max-tokens", "12", "-t", "0")
    assert result.returncode == 0, result.stderr
    assert "loaded base model 'tiny'" in result.stderr
    assert result.stdout.strip()
    assert "<|" not in result.stdout  # plain text continuation: no chat markup


def test_int8_weights_answer_with_a_quarter_of_the_memory(cli_base_dir):
    """--int8 (kernels/int8.py): the loaded line says so, with the weights' bytes against fp32's; the model answers."""
    result = run_cli(cli_base_dir, "-p", "What is the capital of France?", "--max-tokens", "6", "--int8")
    assert result.returncode == 0, result.stderr
    assert "M params (int8)" in result.stderr and "int8 weights: " in result.stderr and "in fp32" in result.stderr
    assert result.stdout.strip() and "cut at 6 tokens" in result.stderr


def test_cpu_threads_leave_a_core_to_the_machine_unless_told(cli_base_dir):
    # One reply decodes as fast on one core fewer, and does not stall when something else wants a core
    # (common.inference_threads); --threads, then $OMP_NUM_THREADS, choose otherwise.
    result = run_cli(cli_base_dir, "-p", "Hi", "--max-tokens", "2", omp_threads=None)
    assert result.returncode == 0, result.stderr
    expected = max(1, (os.cpu_count() or 2) - 1)
    assert f", {expected} torch thread{'s' if expected > 1 else ''}" in result.stderr
    result = run_cli(cli_base_dir, "-p", "Hi", "--max-tokens", "2", "--threads", "3")
    assert result.returncode == 0 and ", 3 torch threads" in result.stderr, result.stderr
    result = run_cli(cli_base_dir, "-p", "Hi", "--threads", "-1")
    assert result.returncode != 0 and "--threads" in result.stderr and "Traceback" not in result.stderr


def test_interactive_session_through_a_pipe(cli_base_dir):
    result = run_cli(cli_base_dir, "--max-tokens", "6", stdin="hello\nclear\nhi\nquit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Assistant: ") == 2  # one reply per message; 'clear' and 'quit' are commands
    assert "(new conversation)" in result.stderr
    assert "Traceback" not in result.stderr

    # after 'clear' the model sees only the new message: its greedy reply is the one-shot reply to that message
    session = run_cli(cli_base_dir, "--max-tokens", "6", "-t", "0", stdin="hello\nclear\nhi\nquit\n")
    one_shot = run_cli(cli_base_dir, "--max-tokens", "6", "-t", "0", "-p", "hi")
    assert session.returncode == 0 and one_shot.returncode == 0, session.stderr + one_shot.stderr
    after_clear = session.stdout.split("Assistant: ")[2].split("\nYou:")[0]
    assert after_clear.strip() == one_shot.stdout.strip()

    result = run_cli(cli_base_dir, "--max-tokens", "6", stdin="hello\n")  # EOF ends the session like quit
    assert result.returncode == 0 and result.stdout.count("Assistant: ") == 1


def test_missing_stage_is_a_one_line_error(cli_base_dir):
    result = run_cli(cli_base_dir, "-i", "mid", "-p", "hi")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: no mid checkpoints") and "Traceback" not in result.stderr
    result = run_cli(cli_base_dir, "-t", "9", "-p", "hi")  # out-of-range flags are refused before loading
    assert result.returncode == 1 and "--temperature" in result.stderr and "Traceback" not in result.stderr


def test_long_conversation_drops_oldest_turns_instead_of_crashing(cli_base_dir):
    turns = [f"tell me about river number {i} and the capital city near it" for i in range(12)]
    result = run_cli(cli_base_dir, "--max-tokens", "8", stdin="\n".join(turns) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Assistant: ") == len(turns)
    assert "note: dropped the" in result.stderr and "oldest messages" in result.stderr
    assert "Traceback" not in result.stderr


# -----------------------------------------------------------------------------
# nanochat/serving/chat.py: replies through the real engine with a scripted model


@pytest.fixture(scope="module")
def tokenizer(tiny_base_dir):
    return RustBPETokenizer.from_directory(os.path.join(tiny_base_dir, "tokenizer"))


class ScriptedModel:
    """A stand-in for GPT that writes a fixed script: at reply position i it puts all probability on script[i]."""

    def __init__(self, script, prompt_len, vocab_size, sequence_len=256):
        self.script, self.prompt_len, self.vocab_size = script, prompt_len, vocab_size
        self.config = SimpleNamespace(n_layer=1, n_head=1, n_kv_head=1, n_embd=4, sequence_len=sequence_len)

    def get_device(self):
        return torch.device("cpu")

    def forward(self, ids, kv_cache, logits_at=None):
        B, T = ids.shape
        fed = kv_cache.new_lengths or [T] * B
        ends = [length + n for length, n in zip(kv_cache.lengths, fed)]  # each row's length after this pass
        kv_cache.advance(T)
        logits = torch.full((B, 1 if logits_at is not None else T, self.vocab_size), -100.0)  # the engine asks for the last
        for b, end in enumerate(ends):  # the index of the reply token each row predicts next
            logits[b, -1, self.script[min(max(end - self.prompt_len, 0), len(self.script) - 1)]] = 100.0
        return logits


def scripted_engine(tokenizer, prompt, pieces):
    """An engine whose model writes `pieces` (strings as text, ints as token ids) after the prompt."""
    script = []
    for piece in pieces:
        script.extend(tokenizer.encode(piece) if isinstance(piece, str) else [piece])
    return Engine(ScriptedModel(script, len(prompt), tokenizer.get_vocab_size()), tokenizer)


@pytest.mark.quick
def test_tool_calls_come_out_as_parts_and_read_back(tokenizer):
    special = tokenizer.encode_special
    prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "What is 12*3?"}]})
    forced = [special("<|output_start|>"), *tokenizer.encode("36"), special("<|output_end|>")]
    # the engine forces the calculator's answer: the script's tokens at those positions are never used
    pieces = ["Let me compute. ", special("<|python_start|>"), "12*3", special("<|python_end|>"), *([0] * len(forced)),
              " So it is 36.", special("<|assistant_end|>")]
    engine = scripted_engine(tokenizer, prompt, pieces)
    events = list(generate_replies(engine, prompt, Sampling(temperature=0.0, max_tokens=100)))
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "stop"
    expected = [{"type": "text", "text": "Let me compute. "}, {"type": "python", "text": "12*3"},
                {"type": "python_output", "text": "36"}, {"type": "text", "text": " So it is 36."}]
    assert finish.parts == expected
    script_length = sum(len(tokenizer.encode(p)) if isinstance(p, str) else 1 for p in pieces)
    assert finish.completion_tokens == script_length
    # streamed pieces add up to the parts, and each medium writes tool calls its own way
    writer = MarkupWriter(TERMINAL_MARKUP)
    shown = "".join(writer.write(e.kind, e.text) for e in events if isinstance(e, Piece)) + writer.close()
    assert shown == "Let me compute. [python: 12*3] [output: 36] So it is 36."
    markup = parts_as_markup(expected)
    assert markup == "Let me compute. <|python_start|>12*3<|python_end|><|output_start|>36<|output_end|> So it is 36."
    assert parse_markup(markup) == expected
    # a conversation sent back with the markup (asked for: nanochat_markup) renders exactly as the model wrote it;
    # otherwise text that spells the markers is text
    messages = [{"role": "user", "content": "What is 12*3?"}, {"role": "assistant", "content": markup},
                {"role": "user", "content": "ok"}]
    assert validate_messages(messages, markup=True)[1]["content"] == expected
    assert validate_messages(messages)[1]["content"] == [{"type": "text", "text": markup}]


@pytest.mark.quick
def test_stop_strings_cut_the_reply_even_across_tokens(tokenizer):
    prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "count"}]})
    engine = scripted_engine(tokenizer, prompt, ["one two three four five six"])
    events = list(generate_replies(engine, prompt, Sampling(temperature=0.0, max_tokens=40, stop=["thr", "xyz"])))
    text = "".join(e.text for e in events if isinstance(e, Piece))
    assert text == "one two " and events[-1].reason == "stop"
    assert events[-1].parts == [{"type": "text", "text": "one two "}]
    # no stop string: the script runs to max_tokens
    events = list(generate_replies(engine, prompt, Sampling(temperature=0.0, max_tokens=3)))
    assert events[-1].reason == "length" and events[-1].completion_tokens == 3


@pytest.mark.quick
def test_stream_holds_back_only_what_might_start_a_stop_string(tokenizer):
    stream = ReplyStream(tokenizer, stop=["END"])
    pieces = []
    for token in tokenizer.encode("abc EN"):
        pieces += stream.push(token)
    assert "".join(t for _, t in pieces) == "abc "  # "EN" could still become "END"
    pieces = []
    for token in tokenizer.encode("D more"):
        pieces += stream.push(token)
    assert pieces == [] and stream.finish_reason == "stop" and stream.parts == [{"type": "text", "text": "abc "}]


@pytest.mark.quick
def test_trimming_drops_oldest_turns_then_cuts_the_last_message(tokenizer):
    turns = []
    for i in range(20):
        turns += [{"role": "user", "content": f"question {i} about the river and the sea"},
                  {"role": "assistant", "content": [{"type": "text", "text": f"answer {i} about the capital"}]}]
    system, last = {"role": "system", "content": "be brief"}, {"role": "user", "content": "last"}
    messages = validate_messages([system, *turns, last])
    prompt = fit_conversation(tokenizer, messages, 100)
    assert len(prompt.ids) <= 100 and "oldest messages" in prompt.note
    kept = prompt.messages
    assert kept[0]["role"] == "system" and kept[-1]["content"] == "last"
    assert kept[1:] == messages[-(len(kept) - 1):]  # what stays is the most recent turns, in order
    # one more whole turn would not have fitted: the fewest turns were dropped
    longer = [messages[0]] + messages[-(len(kept) + 1):]
    assert len(tokenizer.render_for_completion({"messages": longer})) > 100
    # a single message longer than the context keeps its end
    huge = validate_messages([{"role": "user", "content": "blah " * 500 + "the question"}])
    prompt = fit_conversation(tokenizer, huge, 60)
    assert len(prompt.ids) <= 60 and prompt.messages[-1]["content"].endswith("the question")
    assert "kept only the last" in prompt.note
    # nothing to do: no note
    assert fit_conversation(tokenizer, validate_messages([{"role": "user", "content": "hi"}]), 60).note == ""


@pytest.mark.quick
@pytest.mark.parametrize("messages, field", [
    ("hi", "messages"),
    ([], "messages"),
    ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "x"}], "messages[1].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "x" * (MAX_MESSAGE_CHARS + 1)}], "messages[0].content"),
    ([{"role": "user", "content": "x" * MAX_MESSAGE_CHARS}] * (MAX_TOTAL_CHARS // MAX_MESSAGE_CHARS + 1), "messages"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "messages"),
    ([{"role": "assistant", "content": "y"}, {"role": "user", "content": "x"}], "messages"),
    ([{"role": "system", "content": "x"}], "messages"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "image", "text": ""}]},
      {"role": "user", "content": "x"}], "messages[1].content[0]"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(RequestError) as error:
        validate_messages(messages)
    assert error.value.field == field and error.value.reason


@pytest.mark.quick
def test_messages_are_normalised():
    messages = validate_messages([{"role": "system", "content": "sys"},
                                  {"role": "user", "content": [{"type": "text", "text": "a"}]},
                                  {"role": "user", "content": "b"}])
    assert messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "a\n\nb"}]


@pytest.mark.quick
@pytest.mark.parametrize("body, field", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": 0}, "top_k"), ({"top_k": 201}, "top_k"), ({"top_k": 5.5}, "top_k"), ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 5000}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"), ({"n": 9}, "n"), ({"seed": "x"}, "seed"),
    ({"stop": [str(i) for i in range(17)]}, "stop"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"),
    ({"temperature": float("nan")}, "temperature"), ({"max_tokens": 10**400}, "max_tokens"),
])
def test_bad_sampling_fields_name_the_field(body, field):
    with pytest.raises(RequestError) as error:
        read_sampling(body, 0.6, 50, 64)
    assert error.value.field == field


@pytest.mark.quick
def test_sampling_defaults_and_folding():
    sampling = read_sampling({"top_k": 40.0, "seed": -1, "stop": "END", "max_completion_tokens": 7}, 0.6, 50, 64)
    got = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_tokens, sampling.num_samples)
    assert got == (0.6, 40, None, 7, 1)
    assert sampling.stop == ["END"] and 0 <= sampling.seed < 2**63
    nucleus_0 = read_sampling({"top_p": 0, "top_k": 40}, 0.6, 50, 64)  # OpenAI's top_p 0: the most likely token
    assert (nucleus_0.top_k, nucleus_0.top_p) == (1, None)
