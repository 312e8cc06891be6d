"""
How deep a chat request goes: the functions a `/v1/chat/completions` request's data passes through from the route to
the token drawn for it, counted as docs/layout.md counts them, and held to that list (CHAIN).

The rule: in each place the request runs (the route's task on the server's event loop, the thread that writes to a
worker's pipe, the worker's loop), the project's functions on the call stack where the request's data is handed on,
from the function that took it in there: the Add message put on the pipe's queue, the Add written to the pipe, the
request's sequences given to the engine, its tokens through the model (GPT.forward, for the prompt and each step
after) and its tokens drawn (sample_next_tokens). A function that is called and returns on the way (checking a field,
rendering the prompt, the model's own layers below GPT.forward) is not on those stacks, so it does not count. The
worker runs in a thread here, the server's event loop in this one; a worker process runs the same loop.
"""

import asyncio
import multiprocessing
import os
import pickle
import queue
import sys
import threading
from multiprocessing.connection import Connection

import httpx
import pytest
import torch
from test_engine import tokenizer  # noqa: F401 (a fixture)

import nanochat.engine
from nanochat.engine import BatchEngine
from nanochat.gpt import GPTConfig, build_model
from nanochat.serving.chat import Add
from nanochat.serving.serve import create_app
from nanochat.serving.workers import EngineLoop, Worker, WorkerPool

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# From the route to the token: at most 12 (docs/layout.md has the same list)
CHAIN = [
    "serving/serve.py:Routes.chat_completion",  # the route: the request's fields, one Sampling, the prompt
    "serving/workers.py:WorkerPool.submit",  # the least loaded worker, once the client's share has room
    "serving/workers.py:Worker.submit",  # the Add message, pickled, queued for the pipe
    "serving/workers.py:Worker._send_outgoing",  # the pipe's writer thread: the event loop never waits on a full pipe
    "serving/workers.py:EngineLoop.run",  # the worker: the Add in, a step of the engine
    "engine.py:BatchEngine.add_group",  # the request's samples, queued for rows
    "engine.py:BatchEngine.step",  # admit, prefill, draw, decode
    "engine.py:BatchEngine._prefill",  # the prompt through the model
    "engine.py:BatchEngine.decode_step",  # each drawn token through the model
    "gpt.py:GPT.forward",
    "engine.py:choose_tokens",  # the rows grouped by how they sample
    "engine.py:sample_next_tokens",  # the draw
]
LIBRARY = os.path.dirname(os.path.abspath(nanochat.engine.__file__)) + os.sep
SINKS = {"BatchEngine.add_group", "GPT.forward", "sample_next_tokens"}


def qualified_name(frame):
    """"Class.method" or "function" of a frame (Python 3.10's code objects have no co_qualname: self's class)."""
    code = frame.f_code
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    owner = frame.f_locals.get("self")
    return f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name


def stack_from(frame):
    """The library's functions on the stack from `frame` outwards, up to the first frame that is not the library's (the
    web framework's, a thread's start), outermost first."""
    names = []
    while frame is not None and frame.f_code.co_filename.startswith(LIBRARY):
        names.append(f"{frame.f_code.co_filename[len(LIBRARY):]}:{qualified_name(frame)}")
        frame = frame.f_back
    return names[::-1]


def is_add(data):
    return isinstance(pickle.loads(data), Add)


def request_stacks(model, tokenizer, body):  # noqa: F811
    """(the reply, the stacks where the request's data was handed on) of one request to an app whose worker loop runs
    in a thread, every thread profiled."""
    stacks = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is queue.Queue.put.__code__ and is_add(frame.f_locals["item"]):
            stacks.append(stack_from(frame.f_back))
        elif code is Connection.send_bytes.__code__ and is_add(frame.f_locals["buf"]):
            stacks.append(stack_from(frame.f_back))
        elif code.co_filename.startswith(LIBRARY) and qualified_name(frame) in SINKS:
            stacks.append(stack_from(frame))

    engine = BatchEngine(model, tokenizer, max_batch=2)
    server_end, worker_end = multiprocessing.Pipe()
    loop_thread = threading.Thread(target=EngineLoop(worker_end, engine).run, name="worker", daemon=True)
    pool = WorkerPool([Worker(0, loop_thread, server_end, rows=2)], queue_timeout=30)
    info = {"id": "nanochat-test", "context": model.config.sequence_len}
    app = create_app(pool, tokenizer, info, {"temperature": 0.0, "top_k": 50, "max_tokens": 8})

    async def ask():
        pool.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=30) as client:
                return await client.post("/v1/chat/completions", json=body)
        finally:
            pool.stop()

    threading.setprofile(profile)  # the threads started from here on: the pipe's writer, the worker's loop
    loop_thread.start()
    sys.setprofile(profile)
    try:
        reply = asyncio.run(ask())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    loop_thread.join(10)
    return reply, stacks


def chain_of(stacks):
    """Every function of the stacks, once, in the order they were first seen."""
    return list(dict.fromkeys(name for stack in stacks for name in stack))


@pytest.fixture(scope="module")
def model(tokenizer):  # noqa: F811
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2,
                       n_embd=32)
    return build_model(config, "cpu").eval()


def test_a_chat_request_reaches_its_token_through_the_listed_functions(model, tokenizer):  # noqa: F811
    """A request for three tokens (the prompt prefilled, two decode steps) goes from the route to each drawn token
    through CHAIN's functions and no others, each stack in CHAIN's order: a layer added on the way fails here."""
    ends = [tokenizer.get_bos_token_id(), tokenizer.encode_special("<|assistant_end|>")]
    body = {"messages": [{"role": "user", "content": "What is 12*3?"}], "max_tokens": 3,
            "logit_bias": {str(token): -100 for token in ends}}  # three tokens, whatever the weights favour
    reply, stacks = request_stacks(model, tokenizer, body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
    chain = chain_of(stacks)
    assert len(CHAIN) <= 12
    assert sorted(chain) == sorted(CHAIN), f"the path from the route to the token is now: {chain}"
    for stack in stacks:  # each hand-off's stack runs down CHAIN, in its order
        assert stack == sorted(stack, key=CHAIN.index), stack
    assert {stack[-1] for stack in stacks} >= {CHAIN[2], CHAIN[3], CHAIN[5], CHAIN[9], CHAIN[11]}  # every hand-off
