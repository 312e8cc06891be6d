"""
The OpenAI API of chat_web (nanochat/serving/serve.py) as the ecosystem uses it: the `openai` client on both endpoints,
streamed and whole, with logprobs checked against the model's own numbers; a calculator reply that reads as text and
its markup variant that renders back to the model's tokens; every refused field's 400; vLLM's tokenizer endpoints;
and lm-evaluation-harness's local-completions and local-chat-completions on local task files, scored as our own code
scores the same items. The model is a tiny GPT that has memorised one calculator conversation (a few seconds of
training), so its reply is known.
"""

import json
import os
import random
import shutil

import httpx
import openai
import pytest
import torch

from test_chat_web import Server, web_base_dir  # noqa: F401 (a fixture: the 2,048-token model)

CONTEXT = 128
QUESTION = [{"role": "user", "content": "What is 3*4?"}]
REPLY = [{"type": "text", "text": "Let me compute: "}, {"type": "python", "text": "3*4"},
         {"type": "python_output", "text": "12"}, {"type": "text", "text": ". So 12."}]


def load(base_dir, tag="calc"):
    from nanochat.checkpoint_manager import load_model_from_dir

    old = os.environ.get("NANOCHAT_BASE_DIR")
    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    try:
        model, tokenizer, _ = load_model_from_dir(os.path.join(base_dir, "chatsft_checkpoints", tag), "cpu")
    finally:
        os.environ.pop("NANOCHAT_BASE_DIR") if old is None else os.environ.__setitem__("NANOCHAT_BASE_DIR", old)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def api_base_dir(tiny_base_dir, tmp_path_factory):
    """The tiny base dir with an sft checkpoint 'calc': a 2-layer GPT trained on one conversation until it says it."""
    from nanochat.checkpoint_manager import checkpoint_dir, save_checkpoint
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.tokenizer import RustBPETokenizer
    from nanochat.recipe import config_dict

    base_dir = str(tmp_path_factory.mktemp("openai_api") / "base")
    shutil.copytree(tiny_base_dir, base_dir)
    tokenizer = RustBPETokenizer.from_directory(os.path.join(base_dir, "tokenizer"))
    ids, mask = tokenizer.render_conversation({"messages": QUESTION + [{"role": "assistant", "content": REPLY}]})
    torch.manual_seed(0)
    model = build_model(GPTConfig(sequence_len=CONTEXT, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2,
                                  n_kv_head=2, n_embd=64), "cpu")
    x, y = torch.tensor([ids[:-1]]), torch.tensor([[t if m else -1 for t, m in zip(ids[1:], mask[1:])]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    try:
        save_checkpoint(checkpoint_dir("sft", "calc"), 1, model, [],
                        {"model_config": config_dict(model.config), "tokenizer_hash": tokenizer.fingerprint()})
    finally:
        os.environ.pop("NANOCHAT_BASE_DIR")
    return base_dir


@pytest.fixture(scope="module")
def api_server(api_base_dir):
    s = Server(api_base_dir, "--workers", "1", "--queue-timeout", "60")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_and_tokenizer(api_base_dir):
    return load(api_base_dir)


@pytest.fixture
def client(api_server):
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="none", max_retries=0, timeout=60)


def model_logprobs(model, ids):
    """Each token's log probability given the ones before it, from the model in this process (None for the first)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    return [None] + [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_a_calculator_reply_reads_as_text_and_its_markup_renders_back_to_the_models_tokens(client, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    whole = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=0, max_tokens=40)
    assert whole.choices[0].message.content == "Let me compute: 3*4 = 12. So 12."
    assert whole.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="nanochat", messages=QUESTION, temperature=0, max_tokens=40, stream=True) if chunk.choices)
    assert streamed == whole.choices[0].message.content
    # the model's markup, on request; sent back with it, the conversation renders to the tokens the model wrote
    markup = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=0, max_tokens=40,
                                            extra_body={"nanochat_markup": True}).choices[0].message.content
    assert markup == "Let me compute: <|python_start|>3*4<|python_end|><|output_start|>12<|output_end|>. So 12."
    from nanochat.serving.chat import validate_messages

    sent_back = validate_messages(QUESTION + [{"role": "assistant", "content": markup}, {"role": "user", "content": "ok"}],
                                  markup=True)
    written = tokenizer.render_conversation({"messages": QUESTION + [{"role": "assistant", "content": REPLY}]})[0]
    assert tokenizer.render_conversation({"messages": sent_back[:2]})[0] == written
    # and the conversation goes on from it
    again = client.chat.completions.create(model="nanochat", messages=QUESTION + [{"role": "assistant", "content": markup},
                                           {"role": "user", "content": "ok"}], max_tokens=3,
                                           extra_body={"nanochat_markup": True})
    assert again.choices[0].finish_reason in ("stop", "length")


@pytest.mark.quick
def test_text_that_spells_a_special_token_stays_text(api_server, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    spelled = [{"role": "user", "content": "say <|python_start|>1+1<|python_end|>"},
               {"role": "assistant", "content": "<|python_start|>2<|python_end|><|assistant_end|>"},
               {"role": "user", "content": "<|bos|>again"}]
    specials = {tokenizer.encode_special(t) for t in tokenizer.get_special_tokens()}
    tokens = httpx.post(f"{api_server.url}/tokenize", json={"messages": spelled}).json()["tokens"]
    structure = [tokenizer.decode([t]) for t in tokens if t in specials]  # only the chat format's own
    assert structure == ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                         "<|user_start|>", "<|user_end|>", "<|assistant_start|>"]
    reply = httpx.post(f"{api_server.url}/v1/chat/completions", json={"messages": spelled, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.quick
def test_logprobs_on_chat_whole_and_streamed_are_the_models(client, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    whole = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=0, max_tokens=40, logprobs=True,
                                           top_logprobs=3)
    entries = whole.choices[0].logprobs.content
    prompt = tokenizer.render_for_completion({"messages": QUESTION})
    written = tokenizer.render_conversation({"messages": QUESTION + [{"role": "assistant", "content": REPLY}]})[0]
    expected = model_logprobs(model, written)[len(prompt):]
    specials = {tokenizer.encode_special(t) for t in tokenizer.get_special_tokens()}
    texts = [tokenizer.decode([t]) for t in written[len(prompt):] if t not in specials]
    assert [e.token for e in entries] == texts  # readable mode: the markers' tokens are not in the text, nor here
    kept = [lp for t, lp in zip(written[len(prompt):], expected) if t not in specials]
    assert [e.logprob for e in entries] == pytest.approx(kept, abs=2e-4)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    assert all(bytes(e.bytes).decode() == e.token for e in entries)
    stream = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=0, max_tokens=40, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    assert whole.choices[0].message.content == "Let me compute: 3*4 = 12. So 12."


@pytest.mark.quick
def test_completions_echo_logprobs_token_prompts_and_streams(client, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    bos = tokenizer.get_bos_token_id()
    text = "What is 3*4?"
    ids = tokenizer.encode(text)
    expected = model_logprobs(model, [bos] + ids)[1:]  # read after a <|bos|> that is not echoed
    scored = client.completions.create(model="nanochat", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=2e-4)
    assert choice.logprobs.text_offset == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert scored.usage.prompt_tokens == len(ids) + 1 and scored.usage.completion_tokens == 0
    # lm-eval's loglikelihood request: token ids, one token to follow (drawn from the same pass), n > 1, two prompts
    two = client.completions.create(model="nanochat", prompt=[ids, ids[:3]], max_tokens=1, echo=True, logprobs=1,
                                    temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and len({c.text for c in two.choices[:2]}) == 1
    for choice, prompt in zip(two.choices, [ids, ids, ids[:3], ids[:3]]):
        lps = choice.logprobs.token_logprobs
        assert len(lps) == len(prompt) + 1 and lps[:-1] == pytest.approx(model_logprobs(model, [bos] + prompt)[1:],
                                                                           abs=2e-4)
        with torch.no_grad():
            greedy = int(model(torch.tensor([[bos] + prompt]))[0, -1].argmax())
        assert choice.logprobs.tokens[-1] == tokenizer.decode([greedy]) and lps[-1] == max(choice.logprobs.top_logprobs[-1].values())
    # a continuation from the engine, streamed, with its logprobs
    chunks = list(client.completions.create(model="nanochat", prompt=ids, max_tokens=6, logprobs=1, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    markers = {tokenizer.decode([tokenizer.encode_special(t)]) for t in tokenizer.get_special_tokens()}
    assert "".join(t for t in tokens if t not in markers) == text and chunks[-1].usage.completion_tokens == len(tokens)
    whole = client.completions.create(model="nanochat", prompt=ids, max_tokens=6, logprobs=1, temperature=0)
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"


REFUSED = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "calls no user tools"),
    ({"tool_choice": "required"}, "tool_choice", "no user tools"),
    ({"response_format": {"type": "json_object"}}, "response_format", "cannot be held to JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format", "JSON"),
    ({"functions": [{"name": "f"}]}, "functions", "calls no user tools"),
    ({"audio": {"voice": "x"}}, "audio", "text only"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"store": True}, "store", "keeps no completions"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with"),
    ({"top_logprobs": 2}, "top_logprobs", "needs \"logprobs\": true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"presence_penalty": 3}, "presence_penalty", "-2"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]", "100"), ({"logit_bias": {"²": 1}}, "logit_bias", "not a token id"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "no hidden reasoning"),
    ({"frobnicate": 1}, "frobnicate", "not a field of the chat completions request"),
    # a message carries role and content: a name, tool calls, any other key, or a part that is not text is refused
    ({"messages": [{**QUESTION[0], "name": "ann"}]}, "messages[0].name", "no participant names"),
    ({"messages": [{**QUESTION[0], "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls", "no user tools"),
    ({"messages": [{**QUESTION[0], "colour": "red"}]}, "messages[0].colour", "not a field of a message"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "image_url: this model reads text only"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "must be a string"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "does not pad"),
    ({"model": 3}, "model", "must be a string"), ({"model": {"id": "nanochat"}}, "model", "must be a string"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
]
COMPLETION_REFUSED = [
    ({"suffix": "end"}, "suffix", "fill in the middle"), ({"best_of": 2}, "best_of", "only 1"),
    ({"logprobs": 6}, "logprobs", "5"), ({"prompt": [[1, 99999]]}, "prompt[0]", "token ids"),
    ({"prompt": []}, "prompt", "must be a string"), ({"prompt": "x" * 40000}, "prompt", "characters"),
    ({"prompt": list(range(1, CONTEXT + 1))}, "prompt", "context"), ({"messages": QUESTION}, "messages", "not a field"),
    ({"best_of": True}, "best_of", "only 1"), ({"max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}, "n", "one answer"),
    ({"prompt": ["hi"] * 9, "n": 8}, "n", "at most 64"), ({"max_tokens": CONTEXT}, "max_tokens", "context is"),
]


@pytest.mark.quick
def test_every_field_is_read_or_refused_with_a_400_naming_it(api_server):
    url = api_server.url
    for extra, field, words in REFUSED:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, **extra}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and words in error["message"], (extra, r.text)
    for extra, field, words in COMPLETION_REFUSED:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and words in error["message"], (extra, r.text)
    # accepted: the no-op fields, tool_choice none/auto without tools, text format, usage in a stream, penalties, bias
    accepted = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u", "metadata": {"k": "v"},
                "store": False, "service_tier": "auto", "parallel_tool_calls": False, "max_completion_tokens": 3,
                "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"5": -100}, "functions": None,
                "stop": ["a", "b", "c", "d", "e"], "model": "nanochat"}  # five stop strings: lm-eval adds its own
    # what clients send back from a reply object: null (or empty) fields of a message count as absent
    sent_back = [*QUESTION, {"role": "assistant", "content": "12", "refusal": None, "tool_calls": [], "audio": None,
                             "annotations": [], "function_call": None}, {"role": "user", "content": "And 3*5?"}]
    for messages in (QUESTION, sent_back):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, **accepted}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
    # another model's name is the API's 404, on a request as on /v1/models/{id}; the served id and "nanochat" are served
    wrong = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "model": "gpt-4"}, timeout=60)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    assert [httpx.get(f"{url}/v1/models/{name}").status_code for name in (served, "nanochat", "gpt-4")] == [200, 200, 404]
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert models[0]["context_length"] == CONTEXT == models[0]["max_model_len"]


@pytest.mark.quick
def test_counts_a_client_sees_are_the_tokens_the_server_reads(client, api_server, model_and_tokenizer):
    """max_model_len, /tokenize and usage agree with what is scored: a prompt that fills the context with its reply is
    read as sent (its <|bos|> would not fit), the API's default max_tokens (16) yields to the context, an explicit one
    that cannot fit is a 400 naming it, and a scored prompt of exactly the context is answered."""
    model, tokenizer = model_and_tokenizer
    bos, url = tokenizer.get_bos_token_id(), api_server.url
    force = {"logit_bias": {"300": 100}, "temperature": 0}  # token 300 every time: no reply ends early
    default = client.completions.create(model="nanochat", prompt="x", **force)
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "length"
    ids = [t for t in tokenizer.encode("the river " * 200) if t != bos][:CONTEXT - 5]
    yields = client.completions.create(model="nanochat", prompt=ids, **force)  # <|bos|> + 123 ids: 4 tokens of room
    assert (yields.usage.prompt_tokens, yields.usage.completion_tokens) == (CONTEXT - 4, 4)
    exact = client.completions.create(model="nanochat", prompt=ids, max_tokens=5, **force)  # fits only as sent
    assert (exact.usage.prompt_tokens, exact.usage.completion_tokens) == (CONTEXT - 5, 5)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="nanochat", prompt=ids, max_tokens=6)
    assert error.value.code == "context_length_exceeded" and error.value.param == "max_tokens"
    # lm-eval's windows: a scored prompt of exactly max_model_len ids, and one a token shorter with its one-token reply
    full = [t for t in tokenizer.encode("the river of the town " * 100) if t != bos][:CONTEXT]
    scored = client.completions.create(model="nanochat", prompt=full, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(model_logprobs(model, full), abs=2e-4)
    assert scored.usage.prompt_tokens == CONTEXT
    one = client.completions.create(model="nanochat", prompt=full[:-1], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lps = one.choices[0].logprobs.token_logprobs
    assert one.usage.prompt_tokens == CONTEXT and lps[:-1] == pytest.approx(model_logprobs(model, [bos] + full[:-1])[1:],
                                                                            abs=2e-4)
    # /tokenize: add_generation_prompt and add_special_tokens honoured for messages; a prompt as long as the body allows
    conversation = QUESTION + [{"role": "assistant", "content": REPLY}]
    whole = tokenizer.render_conversation({"messages": conversation}, max_tokens=None)[0]
    as_sent = httpx.post(f"{url}/tokenize", json={"messages": conversation, "add_generation_prompt": False}).json()
    assert as_sent["tokens"] == whole and as_sent["count"] == len(whole)
    for_reply = httpx.post(f"{url}/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert for_reply == tokenizer.render_for_completion({"messages": QUESTION}) and for_reply[-1] != whole[-1]
    without_prompt = httpx.post(f"{url}/tokenize", json={"messages": QUESTION, "add_generation_prompt": False}).json()
    assert without_prompt["tokens"] == for_reply[:-1]  # no <|assistant_start|>
    doubled = httpx.post(f"{url}/tokenize", json={"messages": QUESTION, "add_special_tokens": True}).json()["tokens"]
    assert doubled == [bos] + for_reply  # as vLLM: the template writes its own <|bos|>
    long_text = "a long document about the river. " * 3000  # ~100,000 characters
    long_ids = httpx.post(f"{url}/tokenize", json={"prompt": long_text, "add_special_tokens": False}, timeout=60).json()
    assert long_ids["tokens"] == tokenizer.encode(long_text)
    back = httpx.post(f"{url}/detokenize", json={"tokens": long_ids["tokens"]}, timeout=60).json()["prompt"]
    assert back == long_text


@pytest.mark.quick
def test_logprobs_of_tokens_that_hold_part_of_a_character(client, model_and_tokenizer):
    """A token of a character's first byte: its `bytes` are that byte, not U+FFFD's; text_offset indexes the text the
    reply returns, each token at the character it begins or continues."""
    _, tokenizer = model_and_tokenizer
    text = "naïve café 日本 ☃"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.enc.decode_single_token_bytes(t) for t in ids]
    assert any(not p.decode("utf-8", errors="ignore") for p in pieces)  # some token holds only part of a character
    echoed = client.completions.create(model="nanochat", prompt=text, max_tokens=0, echo=True, logprobs=1).choices[0]
    expected = [len(b"".join(pieces[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    assert echoed.text == text and echoed.logprobs.text_offset == expected and max(expected) < len(text)
    first_byte = tokenizer.enc.encode_single_token("日".encode()[:1])
    reply = client.chat.completions.create(model="nanochat", messages=QUESTION, max_tokens=1, logprobs=True,
                                           logit_bias={str(first_byte): 100})
    entry = reply.choices[0].logprobs.content[0]
    assert entry.bytes == list("日".encode()[:1]) and entry.token == "\ufffd"


@pytest.mark.quick
def test_logit_bias_and_penalties_steer_the_sampler(client, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    first = tokenizer.encode("Let")[0]
    plain = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=0, max_tokens=1, logprobs=True)
    assert plain.choices[0].logprobs.content[0].token == "Let"
    biased = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=0, max_tokens=1,
                                            logit_bias={str(first): -100}, logprobs=True)
    assert biased.choices[0].logprobs.content[0].token != "Let"
    forced = client.completions.create(model="nanochat", prompt="x", temperature=0, max_tokens=4, logit_bias={"300": 100})
    assert forced.choices[0].text == tokenizer.decode([300] * 4)
    penalised = client.completions.create(model="nanochat", prompt="x", temperature=0, max_tokens=4, logit_bias={"300": 100},
                                          frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].text == tokenizer.decode([300] * 4)  # +100 outweighs 4 x 2 + 2 of penalty
    near_zero = client.chat.completions.create(model="nanochat", messages=QUESTION, temperature=1e-300, max_tokens=40)
    assert near_zero.choices[0].message.content == "Let me compute: 3*4 = 12. So 12."  # greedy, not NaN


@pytest.mark.quick
def test_vllms_tokenizer_endpoints(api_server, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    url = api_server.url
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == info["bos_token"] == "<|bos|>" and info["model_max_length"] == CONTEXT
    assert "{%" in info["chat_template"]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert ids["tokens"] == tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
    with_bos = httpx.post(f"{url}/tokenize", json={"prompt": "<|bos|>Hi"}).json()["tokens"]
    assert with_bos[:2] == [tokenizer.get_bos_token_id()] * 2  # as vLLM: <|bos|> spelled in the prompt is the token
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def write_lm_eval_tasks(directory, items):
    """Local task files lm-evaluation-harness reads without the hub: a multiple-choice task (loglikelihood), a
    generate_until task on plain text and a chat one, on the same JSONL."""
    os.makedirs(directory, exist_ok=True)
    data = os.path.join(directory, "items.jsonl")
    with open(data, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    with open(os.path.join(directory, "nano_mc.yaml"), "w") as f:
        f.write("task: nano_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{query}}'\n"
                "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
    for name in ("nano_gen", "nano_chat"):
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            f.write(f"task: {name}\n" + common + "output_type: generate_until\ndoc_to_text: '{{query}}'\n"
                    "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 6\n"
                    "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def test_lm_evaluation_harness_scores_equal_our_own(api_server, model_and_tokenizer, tmp_path, monkeypatch):
    """local-completions (loglikelihood and generate_until, the tokenizer remote) and local-chat-completions against the
    server, on local files. Every item's response equals our own code's for it: CORE's scorer for the multiple choice
    (its choices are one token each, so its mean loss is minus lm-eval's log-likelihood), and greedy generation with
    our engines for the other two; so do the scores."""
    lm_eval = pytest.importorskip("lm_eval")  # a dev dependency: in CI it is there
    from lm_eval.tasks import TaskManager

    from nanochat import core_eval
    from nanochat.engine import Engine
    from nanochat.serving.chat import READABLE_MARKUP, parse_markup, parts_as_markup
    from nanochat import chat_eval

    model, tokenizer = model_and_tokenizer
    words = ["city", "language", "people", "name"]
    items = [{"query": f"What is {a}*{b}? The answer is", "choices": words, "gold": (a + b) % 4,
              "answer": words[(a * b) % 4]} for a in range(2, 6) for b in range(3, 5)]
    assert all(len(tokenizer.encode(" " + w)) == 1 for w in words)
    write_lm_eval_tasks(str(tmp_path / "tasks"), items)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    manager = TaskManager(include_path=str(tmp_path / "tasks"))
    base = f"base_url={api_server.url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,model=nanochat"
    out = lm_eval.simple_evaluate(model="local-completions", model_args=base, tasks=["nano_mc", "nano_gen"],
                                  task_manager=manager, log_samples=True)
    chat = lm_eval.simple_evaluate(model="local-chat-completions", apply_chat_template=True, tasks=["nano_chat"],
                                   model_args=f"base_url={api_server.url}/v1/chat/completions,model=nanochat",
                                   task_manager=manager, log_samples=True)
    samples = {name: sorted(s, key=lambda x: x["doc_id"]) for name, s in {**out["samples"], **chat["samples"]}.items()}
    # multiple choice: CORE's mean loss of each one-token choice, after <|bos|> (as the server reads a prompt)
    meta = {"task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "}
    core_items = [{"query": it["query"], "choices": words, "gold": it["gold"]} for it in items]
    correct = 0
    for i, sample in enumerate(samples["nano_mc"]):
        rows, spans = core_eval.tokenize_prompts(tokenizer, "multiple_choice",
                                                 core_eval.render_prompts("multiple_choice", core_items[i], " ", []))
        losses, _ = core_eval.score_rows(model, rows, spans, tokenizer.get_bos_token_id(), "cpu")
        assert [-r[0][0] for r in sample["resps"]] == pytest.approx(losses, abs=2e-4)
        correct += core_eval.evaluate_example(model, tokenizer, core_items, i, "cpu", meta)
    assert out["results"]["nano_mc"]["acc,none"] == pytest.approx(correct / len(items))
    # generate_until on plain text: greedy, ended by a special token (a base model's end of text) or the stop string
    engine, bos = Engine(model, tokenizer), tokenizer.get_bos_token_id()
    specials = {tokenizer.encode_special(t) for t in tokenizer.get_special_tokens()}
    hits = 0
    for it, sample in zip(items, samples["nano_gen"]):
        prompt = [bos] + tokenizer.encode(it["query"])
        ids = next(iter(engine.generate(prompt, max_tokens=6, temperature=0)), None) and \
            engine.generate_batch(prompt, max_tokens=6, temperature=0)[0][0][len(prompt):]
        ids = ids[:next((k for k, t in enumerate(ids) if t in specials), len(ids))]
        text = tokenizer.decode(ids).split("\n\n")[0]
        assert sample["resps"][0][0] == text and text, (sample["resps"], text)
        hits += text == it["answer"]
    assert out["results"]["nano_gen"]["exact_match,none"] == pytest.approx(hits / len(items))
    # the chat task: chat_eval's replies, written as the API writes them (a calculator call as "3*4 = 12")
    replies = chat_eval.sample_task_replies(model, tokenizer, [{"messages": [{"role": "user", "content": it["query"]}]}
                                                            for it in items], max_tokens=6)
    readable = [parts_as_markup(parse_markup(reply), READABLE_MARKUP).split("\n\n")[0] for reply in replies]
    assert [s["resps"][0][0] for s in samples["nano_chat"]] == readable and all(readable), readable
    hits = sum(reply == it["answer"] for reply, it in zip(readable, items))
    assert chat["results"]["nano_chat"]["exact_match,none"] == pytest.approx(hits / len(items))


def write_long_tasks(directory, documents, queries, until):
    """A perplexity task over whole documents (loglikelihood_rolling) and a generate_until task with several stop
    strings, as local files."""
    os.makedirs(directory, exist_ok=True)
    files = {}
    for name, rows in (("docs", [{"text": d} for d in documents]), ("queries", [{"query": q} for q in queries])):
        files[name] = os.path.join(directory, f"{name}.jsonl")
        with open(files[name], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    with open(os.path.join(directory, "nano_ppl.yaml"), "w") as f:
        f.write("task: nano_ppl\n" + common.format(files["docs"]) + "output_type: loglikelihood_rolling\n"
                "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
                "  - metric: bits_per_byte\n")
    with open(os.path.join(directory, "nano_until.yaml"), "w") as f:
        f.write("task: nano_until\n" + common.format(files["queries"]) + "output_type: generate_until\n"
                f"doc_to_text: '{{{{query}}}}'\ndoc_to_target: ''\ngeneration_kwargs:\n  until: {json.dumps(until)}\n"
                "  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def rolling_loglikelihood(model, tokenizer, text, max_length):
    """A document's log-likelihood as lm-evaluation-harness windows it for an API model of this max_length (its own
    utils), each window scored in this process as the server reads it: after a <|bos|>, unless it begins with one."""
    from lm_eval import utils

    bos = tokenizer.get_bos_token_id()
    total = 0.0
    windows = utils.get_rolling_token_windows(tokenizer.encode(text), prefix_token=bos, max_seq_len=max_length - 2,
                                              context_len=1)
    for context, continuation in map(utils.make_disjoint_window, windows):
        ids = context + continuation
        read = ids if ids[0] == bos else [bos] + ids
        assert len(read) <= model.config.sequence_len
        total += sum(model_logprobs(model, read)[-len(continuation):])
    return total


@pytest.mark.slow  # ~40 s: two servers, lm-eval's perplexity over ~30,000-character documents and a generation task
def test_lm_eval_perplexity_over_documents_longer_than_the_context(api_server, model_and_tokenizer, web_base_dir,
                                                                   tmp_path, monkeypatch):
    """lm-evaluation-harness's local-completions with the remote tokenizer, on documents ~4x the context: with its
    defaults (max_length 2,048) against a 2,048-token model, and with max_length the advertised max_model_len of a
    128-token one; each document's log-likelihood equals scoring lm-eval's own windows in this process. A
    generate_until task with 4 stop strings (lm-eval adds a fifth, its end of text) runs at num_concurrent 1, its
    replies our greedy ones cut at the first stop."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from nanochat.engine import Engine

    rng = random.Random(0)
    words = "the river town of old stone bridge where people walk and talk about the weather in spring".split()
    documents = [" ".join(rng.choice(words) for _ in range(5000)) + "." for _ in range(2)]  # ~30,000 characters each
    queries = ["Where is the river? The", "People walk and", "In spring the town"]
    until = ["\n\n", "Question:", "?", " stone"]
    write_long_tasks(str(tmp_path / "tasks"), documents, queries, until)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    manager = TaskManager(include_path=str(tmp_path / "tasks"))
    long_server = Server(web_base_dir, "--workers", "1", "--queue-timeout", "60")
    try:
        long_model, long_tokenizer = load(web_base_dir, "tiny")
        results = []
        for url, max_length, (model, tokenizer), tasks in (
                (long_server.url, None, (long_model, long_tokenizer), ["nano_ppl", "nano_until"]),
                (api_server.url, CONTEXT, model_and_tokenizer, ["nano_ppl"])):
            args = f"base_url={url}/v1/completions,tokenizer_backend=remote,model=nanochat,num_concurrent=1"
            out = lm_eval.simple_evaluate(model="local-completions", tasks=tasks, task_manager=manager, log_samples=True,
                                          model_args=args + (f",max_length={max_length}" if max_length else ""))
            samples = sorted(out["samples"]["nano_ppl"], key=lambda s: s["doc_id"])
            for document, sample in zip(documents, samples):
                expected = rolling_loglikelihood(model, tokenizer, document, max_length or 2048)
                assert sample["resps"][0][0] == pytest.approx(expected, rel=1e-4), (url, max_length)
            assert out["results"]["nano_ppl"]["word_perplexity,none"] > 1
            results.append(out)
        engine, bos = Engine(long_model, long_tokenizer), long_tokenizer.get_bos_token_id()
        replies = [s["resps"][0][0] for s in sorted(results[0]["samples"]["nano_until"], key=lambda s: s["doc_id"])]
        for query, reply in zip(queries, replies):
            ids = engine.generate_batch([bos] + long_tokenizer.encode(query), max_tokens=12, temperature=0)[0][0]
            text = long_tokenizer.decode(ids[len(long_tokenizer.encode(query)) + 1:])
            assert reply == text[:min([text.find(s) for s in until if s in text] or [len(text)])], (reply, text)
    finally:
        long_server.stop()
