"""
Continuous batching (nanochat/engine.py): sequences of different prompt lengths decode together, join and leave
at any step, and each row's tokens are what decoding it alone gives; prefill is chunked without stalling the others;
per-row sampling, stop tokens, max_tokens and calculator output; one KV cache, reused.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from test_engine import tool_script, tokenizer  # noqa: F401 (a fixture)

from nanochat.engine import BatchEngine, Engine, Sampling
from nanochat.gpt import GPTConfig, build_model
from nanochat.kernels.decode_graphs import use_decode
from nanochat.serving.fair_share import DecodeCost, FairShare, measure_decode_cost

pytestmark = pytest.mark.usefixtures("single_torch_thread")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 64  # with sliding_window the short layers see 32 positions: these prompts and replies cross that


@pytest.fixture(scope="module")
def model(tokenizer):  # noqa: F811
    """Every component on (value embeddings, lambdas, smear, backout, sliding windows), GQA, random weights."""
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=CONTEXT, vocab_size=tokenizer.get_vocab_size(), n_layer=4, n_head=4, n_kv_head=2,
                       n_embd=32, value_embeds=True, residual_scalars=True, smear=True, backout=True, sliding_window=True)
    model = build_model(config, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0 if p.ndim < 2 or p is model.transformer.wte.weight else p.shape[1] ** -0.5)
    return model.eval()


def prompts(tokenizer, lengths):  # noqa: F811
    text = tokenizer.encode("The quick brown fox jumps over the lazy dog. What is 12*3? It is 36. " * 4)
    return [[tokenizer.get_bos_token_id()] + text[:n - 1] for n in lengths]


def alone(model, tokenizer, prompt, max_tokens, **sampling):  # noqa: F811
    return [column[0] for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=max_tokens, **sampling)]


def run(engine, joins):
    """Step the engine to the end; joins = {step: [(prompt, Sampling), ...]} adds sequences before that step.
    Returns ({id(seq): tokens}, sequences in order added, [(step, seqs emitting)])."""
    tokens, seqs, trace, step = {}, [], [], 0
    while engine.busy() or any(s >= step for s in joins):
        for prompt, sampling in joins.get(step, []):
            seq = engine.add(prompt, sampling)
            tokens[id(seq)] = []
            seqs.append(seq)
        emitted = engine.step()
        trace.append([seq for seq, _, _ in emitted])
        for seq, token, _ in emitted:
            tokens[id(seq)].append(token)
        step += 1
        assert step < 500
    return tokens, seqs, trace


@pytest.mark.quick
def test_rows_decode_together_exactly_as_each_alone(model, tokenizer):  # noqa: F811
    """Prompts of 1 to 40 tokens, joining at different steps, a 40-token prompt prefilled 8 tokens a step: every
    row's greedy tokens equal Engine.generate on that prompt alone, across the sliding window."""
    ps = prompts(tokenizer, [1, 5, 17, 40])
    greedy = Sampling(temperature=0.0, max_tokens=20)
    engine = BatchEngine(model, tokenizer, max_batch=4, prefill_chunk=8)
    tokens, seqs, trace = run(engine, {0: [(ps[0], greedy), (ps[1], greedy)], 3: [(ps[2], greedy)], 6: [(ps[3], greedy)]})
    for prompt, seq in zip(ps, seqs):
        expected = alone(model, tokenizer, prompt, 20, temperature=0.0)
        assert tokens[id(seq)] == expected and seq.finished in ("stop", "length")
    assert max(len(p) for p in ps) + 20 > 32  # the window really cuts
    # while the 40-token prompt took its 5 prefill steps, the rows already running wrote a token at every one
    running_then = seqs[:2]
    for step in range(6, 11):
        assert all(seq in trace[step] for seq in running_then if len(tokens[id(seq)]) > step)


@pytest.mark.quick
def test_rows_decode_in_bf16_autocast_as_each_alone(model, tokenizer, monkeypatch):  # noqa: F811
    """A GPU's dtypes: bf16 autocast and a bf16 cache, values that come out of the value embeddings in fp32; rows of
    different lengths decode together as each does alone in bf16."""
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    for module in ("nanochat.engine", "nanochat.engine"):  # a CPU's cache is fp32: stand in for a GPU's
        monkeypatch.setattr(f"{module}.kv_cache_dtype", lambda device: torch.bfloat16)
    ps = prompts(tokenizer, [3, 21])
    greedy = Sampling(temperature=0.0, max_tokens=12)
    engine = BatchEngine(model, tokenizer, max_batch=2, prefill_chunk=8)
    assert engine.cache.k_cache.dtype == torch.bfloat16
    tokens, seqs, _ = run(engine, {0: [(ps[0], greedy)], 2: [(ps[1], greedy)]})
    for prompt, seq in zip(ps, seqs):
        assert tokens[id(seq)] == alone(model, tokenizer, prompt, 12, temperature=0.0)



@pytest.mark.quick
def test_a_cpu_in_bf16_caches_and_attends_in_fp32(model, tokenizer, monkeypatch):  # noqa: F811
    """On a bf16 CPU the cache is fp32 and decode attention runs in fp32 with autocast off (torch's CPU attention is
    4-7x slower in bf16 for one query per row); rows still decode together as each does alone."""
    import torch.nn.functional as F

    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    seen, sdpa = [], F.scaled_dot_product_attention
    def recording_sdpa(q, k, v, **kwargs):
        seen.append((q.size(2), q.dtype, k.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    ps = prompts(tokenizer, [4, 13])
    greedy = Sampling(temperature=0.0, max_tokens=10)
    engine = BatchEngine(model, tokenizer, max_batch=2, prefill_chunk=8)
    assert engine.cache.k_cache.dtype == torch.float32
    tokens, seqs, _ = run(engine, {0: [(ps[0], greedy)], 1: [(ps[1], greedy)]})
    decode_calls = [call for call in seen if call[0] == 1]
    assert decode_calls and all(call[1:] == (torch.float32, torch.float32, False) for call in decode_calls)
    for prompt, seq in zip(ps, seqs):
        assert tokens[id(seq)] == alone(model, tokenizer, prompt, 10, temperature=0.0)


@pytest.mark.quick
def test_model_prepared_for_inference_gives_what_it_gave(model, tokenizer, monkeypatch):  # noqa: F811
    """The generating scripts prepare the model: q, k, v and the value-embedding gate from one stacked matmul, and on
    a bf16 CPU the linears stored in bf16 once instead of autocast casting them per call. In fp32 the logits agree to
    rounding (the stacked matmul sums in another order) and greedy decoding gives the same tokens; in bf16 the values
    are the ones autocast made, so the logits are equal bit for bit."""
    import copy

    from nanochat.common import autocast_for

    fp32_copy = copy.deepcopy(model).prepare_for_inference()  # the suite's fp32: the weights stay fp32
    assert fp32_copy.lm_head.weight.dtype == torch.float32
    assert all(block.attn.inference_weight is not None for block in fp32_copy.transformer.h)
    originals = dict(model.named_parameters())
    assert all(torch.equal(p, originals[name]) for name, p in fp32_copy.named_parameters())  # the same values ...
    attn = fp32_copy.transformer.h[0].attn
    for linear in (attn.c_q, attn.c_k, attn.c_v, attn.ve_gate):  # ... held once: views into the stacked matrix
        assert linear.weight.untyped_storage().data_ptr() == attn.inference_weight.untyped_storage().data_ptr()
    ids = torch.tensor([prompts(tokenizer, [30])[0]])
    with torch.inference_mode():
        torch.testing.assert_close(fp32_copy(ids), model(ids), rtol=1e-5, atol=1e-5)
    prompt = prompts(tokenizer, [9])[0]
    assert alone(fp32_copy, tokenizer, prompt, 16, temperature=0.0) == alone(model, tokenizer, prompt, 16, temperature=0.0)
    fp32_copy(ids, ids).backward()  # with grad the separate weights run, so a backward reaches every one of them
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in (attn.c_q.weight, attn.c_v.weight, attn.ve_gate.weight))
    moved = fp32_copy.to(torch.float64)  # .to() carries the stacked weight along (a buffer, never saved)
    assert moved.transformer.h[0].attn.inference_weight.dtype == torch.float64
    assert not any("inference_weight" in name for name in moved.state_dict())
    with torch.inference_mode():
        torch.testing.assert_close(moved(ids).float(), model(ids), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    monkeypatch.setattr("nanochat.gpt.get_compute_dtype", lambda device: torch.bfloat16)
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.setenv(name, "")  # recorded, so the test's end restores whatever was there (or nothing)
        monkeypatch.delenv(name)
    cast = copy.deepcopy(model).prepare_for_inference()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == os.environ["LRU_CACHE_CAPACITY"] == "32"  # bounded
    assert cast.transformer.h[0].attn.c_q.weight.dtype == torch.bfloat16 and cast.lm_head.weight.dtype == torch.bfloat16
    assert cast.transformer.wte.weight.dtype == torch.float32  # embeddings (and norms, scalars) stay fp32
    with torch.inference_mode(), autocast_for("cpu"):
        assert torch.equal(cast(ids), model(ids))
    assert alone(cast, tokenizer, prompt, 16, temperature=0.0) == alone(model, tokenizer, prompt, 16, temperature=0.0)



BF16_SHAPES_SCRIPT = """
import os, sys, torch
from nanochat.common import bound_onednn_caches
if sys.argv[1] == "bounded":
    bound_onednn_caches()
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
weight = torch.randn(512, 256, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 256, dtype=torch.bfloat16), weight)
before = rss_mib()
for rows in range(2, 202):  # a server's decode steps and prefills: a new batch shape again and again
    torch.nn.functional.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
print(rss_mib() - before)
"""


def test_bf16_matmuls_of_ever_new_shapes_keep_memory_bounded():
    """oneDNN keeps ~0.7 MiB per bf16 matmul shape in caches of 1024 entries; a generating process bounds them
    (common.bound_onednn_caches), else 200 batch shapes cost ~130 MiB here and a server's memory grew with load."""
    from nanochat.common import has_fast_bf16

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    def growth_mib(mode):
        out = subprocess.run([sys.executable, "-c", BF16_SHAPES_SCRIPT, mode], capture_output=True, text=True,
                             check=True, env=dict(env, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1"))
        return float(out.stdout.strip())
    assert growth_mib("bounded") < 70
    if has_fast_bf16(torch.device("cpu")):  # bf16 matmuls in oneDNN (this CPU): unbounded, the same loop grows
        assert growth_mib("default") > 100


@pytest.mark.quick
def test_chat_eval_takes_no_more_rows_than_the_kv_memory_holds(model, tokenizer, monkeypatch):  # noqa: F811
    """chat_eval decodes up to 32 problems at once, but no more rows than the device's KV memory holds (a CPU's cache
    is fp32: an imported d20 would otherwise allocate 13 GB), and the replies do not depend on the batch."""
    from nanochat import chat_eval
    from nanochat.engine import kv_row_bytes

    engines, batch_engine = [], chat_eval.BatchEngine
    def recording_engine(*args, **kwargs):
        engines.append(batch_engine(*args, **kwargs))
        return engines[-1]
    monkeypatch.setattr(chat_eval, "BatchEngine", recording_engine)
    conversations = [{"messages": [{"role": "user", "content": f"tell me {word}"}]} for word in ("one", "two", "three")]
    wide = chat_eval.sample_task_replies(model, tokenizer, conversations, max_tokens=6)
    monkeypatch.setattr(chat_eval, "kv_memory_bytes", lambda device: 2 * kv_row_bytes(model.config, device) + 1)
    narrow = chat_eval.sample_task_replies(model, tokenizer, conversations, max_tokens=6)
    assert [engine.max_batch for engine in engines] == [32, 2] and narrow == wide

@pytest.mark.quick
def test_sampled_rows_follow_their_own_seed_whatever_the_batch(model, tokenizer):  # noqa: F811
    ps = prompts(tokenizer, [6, 11])
    def sampled(seed):
        return Sampling(temperature=1.0, top_k=20, max_tokens=12, seed=seed)
    single = BatchEngine(model, tokenizer, max_batch=1)
    by_itself, seqs, _ = run(single, {0: [(ps[0], sampled(7))]})
    together, pair, _ = run(BatchEngine(model, tokenizer, max_batch=4), {0: [(ps[1], sampled(3)), (ps[0], sampled(7))]})
    assert together[id(pair[1])] == by_itself[id(seqs[0])]
    other, seqs_other, _ = run(BatchEngine(model, tokenizer, max_batch=1), {0: [(ps[0], sampled(8))]})
    assert other[id(seqs_other[0])] != by_itself[id(seqs[0])]



@pytest.mark.quick
def test_decode_batches_round_up_with_free_rows_that_stay_empty(model, tokenizer, monkeypatch):  # noqa: F811
    """On a bf16 CPU three rows decode as a batch of 4 (a free row pads it: oneDNN then meets few batch shapes), each
    row's tokens still what it gives alone, and the padding row is left empty after every step. In fp32 (MKL, no
    per-shape kernels) batches are not rounded."""
    ps = prompts(tokenizer, [2, 7, 12])
    assert not BatchEngine(model, tokenizer, max_batch=8).round_batches
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    engine = BatchEngine(model, tokenizer, max_batch=8)
    batches, forward = [], model.forward
    def recording_forward(ids, **kwargs):
        if ids.size(1) == 1:
            batches.append(ids.size(0))
        return forward(ids, **kwargs)
    monkeypatch.setattr(model, "forward", recording_forward)
    greedy = Sampling(temperature=0.0, max_tokens=CONTEXT)
    tokens, seqs, _ = run(engine, {0: [(p, greedy) for p in ps]})
    assert batches[0] == 4 and set(batches) <= {1, 2, 4}
    assert engine.cache.lengths == [0] * 8  # row 3 padded every step and was never admitted: nothing kept
    monkeypatch.setattr(model, "forward", forward)
    for prompt, seq in zip(ps, seqs):
        assert tokens[id(seq)] == alone(model, tokenizer, prompt, CONTEXT, temperature=0.0)
    assert engine._padding_rows([0, 2, 5]) == [1]  # a gap inside the run first, then after it, then before
    engine.free_rows = [0, 1, 2, 6, 7]
    assert engine._padding_rows([3, 4, 5]) == [6] and engine._padding_rows([3, 4, 5, 6]) == []
    engine.free_rows = [0, 1, 2]
    assert engine._padding_rows([3, 4, 5, 6, 7]) == [2, 1, 0]

@pytest.mark.quick
def test_rows_leave_at_max_tokens_or_on_cancel_and_the_rest_go_on(model, tokenizer):  # noqa: F811
    ps = prompts(tokenizer, [3, 9, 14])
    engine = BatchEngine(model, tokenizer, max_batch=3)
    short, long_, cancelled = (engine.add(ps[0], Sampling(temperature=0.0, max_tokens=3)),
                               engine.add(ps[1], Sampling(temperature=0.0, max_tokens=25)),
                               engine.add(ps[2], Sampling(temperature=0.0, max_tokens=25)))
    tokens = {id(s): [] for s in (short, long_, cancelled)}
    step = 0
    while engine.busy():
        if step == 5:
            engine.cancel(cancelled)
            assert engine.occupancy()["active"] == 1 and cancelled.row is not None  # freed before the next step
        for seq, token, _ in engine.step():
            tokens[id(seq)].append(token)
        if step == 2:  # the short row wrote its third token at step 2: its row is free for the next step
            assert short.finished == "length" and engine.occupancy()["active"] == 2
        step += 1
    assert tokens[id(short)] == alone(model, tokenizer, ps[0], 3, temperature=0.0)
    assert tokens[id(long_)] == alone(model, tokenizer, ps[1], 25, temperature=0.0)
    assert len(tokens[id(cancelled)]) == 5 and cancelled.finished == "cancelled"
    occupancy = engine.occupancy()
    assert occupancy["shared_steps"] > 0  # the three decoded together while they all ran
    assert occupancy == {"rows": 3, "active": 0, "waiting": 0, "shared_steps": occupancy["shared_steps"]}
    assert sorted(engine.free_rows) == [0, 1, 2]


@pytest.mark.quick
def test_samples_of_one_prompt_share_one_prefill_and_a_full_batch_waits(model, tokenizer):  # noqa: F811
    calls = []
    original = model.forward

    def counting(ids, **kwargs):
        calls.append(tuple(ids.shape))
        return original(ids, **kwargs)

    prompt = prompts(tokenizer, [12])[0]
    engine = BatchEngine(model, tokenizer, max_batch=3)
    model.forward = counting
    try:
        group = engine.add_group(prompt, [Sampling(temperature=0.0, max_tokens=6)] * 3)
        waiting = engine.add(prompt, Sampling(temperature=0.0, max_tokens=6))  # no row left: it waits its turn
        tokens = {id(s): [] for s in group + [waiting]}
        while engine.busy():
            for seq, token, _ in engine.step():
                tokens[id(seq)].append(token)
            if waiting.row is None:
                assert engine.occupancy()["waiting"] == 1
    finally:
        model.forward = original
    expected = alone(model, tokenizer, prompt, 6, temperature=0.0)
    assert all(tokens[id(s)] == expected for s in group + [waiting])
    assert calls.count((1, len(prompt))) == 2  # one prefill for the group of three, one for the late request


class RowScriptedModel(nn.Module):
    """The per-row cache protocol with scripted outputs: row r's next token is choose[r](its history, prompt_len)."""

    def __init__(self, vocab_size, chooses):
        super().__init__()
        self.config = SimpleNamespace(n_layer=1, n_head=1, n_kv_head=1, n_embd=2, sequence_len=64)
        self.vocab_size, self.chooses = vocab_size, chooses
        self.histories, self.prompt_lens = {}, {}

    def get_device(self):
        return torch.device("cpu")

    def forward(self, ids, kv_cache, logits_at=None):
        logits = torch.full((ids.size(0), ids.size(1), self.vocab_size), -100.0)
        real = kv_cache.new_lengths or [ids.size(1)] * ids.size(0)  # prompts prefilled together are padded
        for i, (row, length) in enumerate(zip(kv_cache.indices, kv_cache.lengths)):
            if length == 0:  # a new sequence in this row: these are its prompt (one chunk: the prompts are short)
                self.histories[row], self.prompt_lens[row] = [], real[i]
            self.histories[row] = self.histories[row] + ids[i, :real[i]].tolist()
            logits[i, real[i] - 1, self.chooses[row](self.histories[row], self.prompt_lens[row])] = 0.0
        kv_cache.advance(ids.size(1))
        return logits if logits_at is None else logits[torch.arange(ids.size(0)), logits_at][:, None]


@pytest.mark.quick
def test_a_tool_call_in_one_row_forces_its_answer_there_only(tokenizer):  # noqa: F811
    special = tokenizer.encode_special
    script, filler, tool = tool_script(tokenizer, "12*3")
    plain = tokenizer.encode("a")[0]
    model = RowScriptedModel(tokenizer.get_vocab_size(), {0: tool, 1: lambda history, prompt_len: plain})
    engine = BatchEngine(model, tokenizer, max_batch=2)
    bos = tokenizer.get_bos_token_id()
    calc, other = engine.add([bos, 5, 6], Sampling(temperature=0.0, max_tokens=30)), \
        engine.add([bos], Sampling(temperature=0.0, max_tokens=8))
    out = {id(calc): [], id(other): []}
    while engine.busy():
        for seq, token, mask in engine.step():
            out[id(seq)].append((token, mask))
    forced = [special("<|output_start|>"), *tokenizer.encode("36"), special("<|output_end|>")]
    end = special("<|assistant_end|>")
    assert out[id(calc)] == [(t, 1) for t in script] + [(t, 0) for t in forced] + [(end, 1)]
    assert calc.finished == "stop"
    assert out[id(other)] == [(plain, 1)] * 8 and other.finished == "length"
    assert model.histories[0][3:] == script + forced  # the answer went through the model in its own row


@pytest.mark.quick
def test_the_kv_cache_is_allocated_once_and_its_rows_reused(model, tokenizer):  # noqa: F811
    engine = BatchEngine(model, tokenizer, max_batch=2)
    pointer = engine.cache.k_cache.data_ptr()
    ps = prompts(tokenizer, [4, 8, 12, 16, 20])
    for batch in (ps[:2], ps[2:4], ps[4:]):
        tokens, seqs, _ = run(engine, {0: [(p, Sampling(temperature=0.0, max_tokens=5)) for p in batch]})
        for prompt, seq in zip(batch, seqs):
            assert tokens[id(seq)] == alone(model, tokenizer, prompt, 5, temperature=0.0)  # a reused row is clean
    assert engine.cache.k_cache.data_ptr() == pointer and sorted(engine.free_rows) == [0, 1]
    with pytest.raises(ValueError, match="prompt needs 1 to"):
        engine.add(list(range(1, CONTEXT + 1)), Sampling())
    with pytest.raises(ValueError, match="more than the 2 rows"):
        engine.add_group(ps[0], [Sampling()] * 3)


@pytest.mark.quick
def test_the_static_decode_step_gives_the_eager_tokens(model, tokenizer):  # noqa: F811
    """decode="captured" (static shapes: rows 0..bucket, keys up to an extent bucket, every input a device tensor; on a
    GPU replayed as CUDA graphs, here run eagerly): the same tokens as the eager step, token for token, while a long
    prompt prefills in chunks beside rows that decode (its row unfed, its cache and smear state untouched), with n
    samples of one prompt, a row cancelled mid-way, rows reused, and replies that cross the sliding window."""
    ps = prompts(tokenizer, [1, 5, 17, 40, 9])
    greedy, sampled = Sampling(temperature=0.0, max_tokens=24), Sampling(temperature=0.9, top_k=50, max_tokens=24, seed=7)
    joins = {0: [(ps[0], greedy), (ps[1], sampled)], 2: [(ps[3], greedy)], 5: [(ps[2], greedy)], 12: [(ps[4], sampled)]}
    results = {}
    for decode in ("eager", "captured"):
        engine = BatchEngine(model, tokenizer, max_batch=4, prefill_chunk=8)
        captured = use_decode(engine, decode)
        seqs = engine.add_group(ps[4], [Sampling(temperature=0.0, max_tokens=10), sampled])
        tokens = {id(seq): [] for seq in seqs}
        for step in range(200):
            for prompt, sampling in joins.get(step, []):
                seqs.append(engine.add(prompt, sampling))
                tokens[id(seqs[-1])] = []
            if step == 7:
                engine.cancel(seqs[3])  # ps[1], sampled: its row frees mid-reply
            for seq, token, _ in engine.step():
                tokens[id(seq)].append(token)
            if not engine.busy() and step > max(joins):
                break
        results[decode] = ([tokens[id(s)] for s in seqs], [s.finished for s in seqs])
    assert results["eager"] == results["captured"]
    lengths = [len(t) for t in results["captured"][0]]
    assert lengths[3] < 24 and max(lengths) == 24 and max(len(p) for p in ps) + 24 > 32  # cancelled; across the window
    assert captured.why_eager.startswith("CUDA graphs need a GPU")
    assert captured.bucket([0, 2], [5, 40]) == (4, 64) and captured.bucket([0], [31]) == (1, 32)
    with pytest.raises(ValueError, match="decode must be one of"):
        use_decode(BatchEngine(model, tokenizer, max_batch=2), "graphs")


@pytest.mark.quick
def test_the_static_decode_step_in_bf16_agrees_to_rounding(model, tokenizer, monkeypatch):  # noqa: F811
    """A GPU's dtypes (bf16 autocast, a bf16 cache): the static step reads its keys to another extent than the eager
    one, so bf16 rounds differently; while the two write the same tokens, their logits agree to bf16's rounding."""
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    monkeypatch.setattr("nanochat.engine.kv_cache_dtype", lambda device: torch.bfloat16)
    ps = prompts(tokenizer, [5, 17, 30])
    engines = {d: BatchEngine(model, tokenizer, max_batch=4, prefill_chunk=8) for d in ("eager", "captured")}
    use_decode(engines["captured"], "captured")
    assert engines["captured"].cache.k_cache.dtype == torch.bfloat16
    seqs = {d: [e.add(p, Sampling(temperature=0.0, max_tokens=30)) for p in ps] for d, e in engines.items()}
    compared = 0
    while engines["eager"].busy():
        tokens = {d: [token for _, token, _ in e.step()] for d, e in engines.items()}
        if tokens["eager"] != tokens["captured"]:
            break  # a near-tie went the other way: from here the rows hold other text
        for a, b in zip(seqs["eager"], seqs["captured"]):
            if a.logits is not None:
                assert (a.logits - b.logits).abs().max() <= 0.03 * a.logits.abs().max(), compared
                compared += 1
    assert compared >= 40


@pytest.mark.quick
def test_decode_controls_compare_logits_only_where_the_tokens_agree():
    """bench/decode_check.py's comparison: a row's logits are compared up to (and with) the step where the tokens
    first differ, never after (their inputs differ from there); the margin at the flip is the first run's top-2 gap."""
    from bench.decode_check import compare

    def logits(*values):
        return torch.tensor(values, dtype=torch.float32)

    first = ([[1, 2, 3], [4, 5]],
             [[None, logits(0.0, 2.0, 1.0), logits(3.0, 0.0, 2.9)], [None, logits(1.0, 0.0, 0.0)]])
    second = ([[1, 2, 0], [4, 5]],
              [[None, logits(0.0, 2.0, 1.01), logits(2.0, 0.0, 3.0)], [None, logits(1.0, 0.0, 0.0)]])
    result = compare(first, second)
    assert result["rows"] == 2 and result["same_rows"] == 1
    assert result["flips_at_margin"] == [pytest.approx(0.1, abs=1e-5)]  # 3.0 - 2.9 where row 0 went 3 against 0
    assert result["max_diff"] == pytest.approx(1.0)  # the flip's own step counts: same inputs, other arithmetic
    assert result["median_max_diff"] == pytest.approx(1.0)  # rows' maxima sorted [0, 1.0]: the upper middle


@pytest.mark.quick
def test_decode_controls_run_every_pair_on_the_cpu(model, tokenizer):  # noqa: F811
    """The five pairs the GPU suite's decode section compares: without CUDA "captured" runs the static step eagerly,
    so the two are the same arithmetic (equal logits), and fp32 eager and static write the same tokens."""
    from bench.decode_check import decode_controls, describe

    ps = prompts(tokenizer, [5, 9, 17])
    pairs = decode_controls(model, tokenizer, ps, 10, rows=3, control_rows=1)
    assert set(pairs) == {"eager_vs_captured", "eager_vs_static", "static_vs_captured", "eager_3_vs_eager_1",
                          "eager_vs_captured_fp32"}
    assert pairs["static_vs_captured"]["same_rows"] == 3 and pairs["static_vs_captured"]["max_diff"] == 0.0
    assert pairs["eager_vs_captured_fp32"]["same_rows"] == 3
    assert pairs["eager_3_vs_eager_1"]["rows"] == 1
    assert describe("eager_vs_captured", pairs["eager_vs_captured"]).startswith("eager vs captured: ")


# -----------------------------------------------------------------------------
# Owners share decode steps (issue 66: one client's 16 rows made another's row advance a token per 16-row step)


def decode_alone(model, tokenizer, prompt, sampling):  # noqa: F811
    return alone(model, tokenizer, prompt, sampling.max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                 seed=sampling.seed)


@pytest.mark.quick
def test_owners_share_decode_steps_and_a_row_that_waits_resumes_exactly(model, tokenizer):  # noqa: F811
    """A step that costs three units and a unit a row (a CPU's kind of cost): beside one owner's single row, another owner's
    6 rows get one row a step (a step of 2 rows costs 1.25 times the single row's, FAIR_STRETCH), each in turn, so the
    single row is fed at every step and each of the 6 every 6th while it runs; then the 6 are fed whole. Every row
    writes exactly the tokens it writes alone, greedy and sampled: a row that waited resumes where it was."""
    ps = prompts(tokenizer, [5, 9, 12, 7, 14, 3, 10])
    samplings = [Sampling(temperature=0.0 if i % 2 else 1.0, top_k=20, max_tokens=20 if i else 12, seed=i)
                 for i in range(7)]
    engine = BatchEngine(model, tokenizer, max_batch=8)
    share = engine.row_policy = FairShare(engine, DecodeCost(fixed=3.0, per_row=1.0, per_row_key=0.0))
    light = engine.add(ps[0], samplings[0], owner="light")
    heavy = [engine.add(prompt, sampling, owner="heavy") for prompt, sampling in zip(ps[1:], samplings[1:])]
    tokens, fed_while_light_ran = {id(seq): [] for seq in [light, *heavy]}, []
    while engine.busy():
        steps = engine.decode_steps
        emitted = engine.step()
        for seq, token, _ in emitted:
            tokens[id(seq)].append(token)
        if light.finished is None and light.generated:  # prefilled, and decoding
            assert light.last_fed == engine.decode_steps > steps  # fed at every step
            fed_while_light_ran.append([i for i, seq in enumerate(heavy) if seq.last_fed == engine.decode_steps])
    for prompt, sampling, seq in zip(ps, samplings, [light, *heavy]):
        assert tokens[id(seq)] == decode_alone(model, tokenizer, prompt, sampling), (prompt, sampling)
    assert len(fed_while_light_ran) >= 10 and all(len(fed) == 1 for fed in fed_while_light_ran), fed_while_light_ran
    turns = [fed[0] for fed in fed_while_light_ran]
    assert all(sorted(turns[i:i + 6]) == list(range(6)) for i in range(len(turns) - 5)), turns  # a strict rotation
    assert share.rows_passed_by >= 5 * len(fed_while_light_ran)
    assert sorted(engine.free_rows) == list(range(8)) and share.carried_seconds == 0.0


@pytest.mark.quick
def test_what_does_not_fit_a_step_waits_its_turn_and_owners_alike_are_fed_whole(model, tokenizer):  # noqa: F811
    """Rows of 40 positions whose keys are dear (a long row makes every row of its step read 40 keys) do not fit a
    step the short row's cost allows at all: the seconds allowed but left unused are carried until the longest-waiting
    one gets in, so they still advance while the short row writes its 12 tokens (once or a few times: each costs ~6 of
    its steps), and write their own tokens. One owner, or two whose rows cost alike, are fed whole at every step, and
    with no row policy every row is fed."""
    ps = prompts(tokenizer, [3, 40, 40, 40])
    greedy = Sampling(temperature=0.0, max_tokens=12)
    engine = BatchEngine(model, tokenizer, max_batch=4)
    engine.row_policy = FairShare(engine, DecodeCost(fixed=1.0, per_row=0.0, per_row_key=0.1))
    light = engine.add(ps[0], greedy, owner=1)
    heavy = [engine.add(prompt, greedy, owner=2) for prompt in ps[1:]]
    tokens = {id(seq): [] for seq in [light, *heavy]}
    while light.finished is None:
        for seq, token, _ in engine.step():
            tokens[id(seq)].append(token)
    fed_heavy = sum(seq.generated for seq in heavy) - len(heavy)  # their first tokens came from the prefill
    assert light.generated == 12 and 1 <= fed_heavy <= 3, [s.generated for s in heavy]
    while engine.busy():
        for seq, token, _ in engine.step():
            tokens[id(seq)].append(token)
    for prompt, seq in zip(ps, [light, *heavy]):
        assert tokens[id(seq)] == alone(model, tokenizer, prompt, 12, temperature=0.0)
    for owners in ([5, 5, 5], [5, 6, 7], None):
        engine = BatchEngine(model, tokenizer, max_batch=3)
        if owners:
            engine.row_policy = FairShare(engine, DecodeCost(fixed=1.0, per_row=1.0, per_row_key=0.01))
        seqs = [engine.add(prompt, greedy, owner=owner) for prompt, owner in zip(ps[1:], owners or [1, 2, 3])]
        while engine.busy():
            engine.step()
        assert all(seq.generated == 12 for seq in seqs) and all(seq.last_fed == engine.decode_steps for seq in seqs)
        assert (engine.row_policy.rows_passed_by if owners else 0) == 0


@pytest.mark.quick
def test_prompts_are_prefilled_owners_in_turn_within_a_share_of_the_others_steps(model, tokenizer):  # noqa: F811
    """While one owner's row decodes, another's long prompts are prefilled in chunks that cost at most PREFILL_SHARE of
    its steps, in the costs given (every step prefilled a whole chunk, oldest prompt first: the decoding row waited
    behind each); a third owner's short prompt, added after them, is prefilled before the rest of theirs (it
    waited behind them all). Every sequence writes the tokens it writes alone."""
    from nanochat.serving.fair_share import PREFILL_SHARE

    ps = prompts(tokenizer, [3, 40, 40, 40, 4])
    engine = BatchEngine(model, tokenizer, max_batch=8, prefill_chunk=16)
    cost = DecodeCost(fixed=1.0, per_row=1.0, per_row_key=0.0, prefill=(1.0, 0.25, 0.0))  # 16 tokens: 5 steps' worth
    engine.row_policy = FairShare(engine, cost)
    steady = Sampling(temperature=0.0, max_tokens=60)
    decoding = engine.add(ps[0], steady, owner="decoding")
    tokens = {id(decoding): [token for _, token, _ in engine.step()]}  # prefilled at once: nothing else decodes
    short = Sampling(temperature=0.0, max_tokens=2)
    long = [engine.add(prompt, short, owner="long") for prompt in ps[1:4]]
    late, chunks, steps = None, [], 0
    while any(seq.prefilled < len(seq.prompt) for seq in long):
        before = sum(seq.prefilled for seq in long)
        for seq, token, _ in engine.step():
            tokens.setdefault(id(seq), []).append(token)
        steps += 1
        if sum(seq.prefilled for seq in long) > before:
            chunks.append(sum(seq.prefilled for seq in long) - before)
            if late is None:
                late = engine.add(ps[4], short, owner="late")
                long_before_late = sum(seq.prefilled for seq in long)
        if late is not None and late.prefilled < len(late.prompt):
            assert sum(seq.prefilled for seq in long) == long_before_late  # its turn comes first
    assert late.prefilled == len(late.prompt) and decoding.finished is None
    # each step earned half a decoding step's cost (1 + 1 a row): the chunks cost no more than that, one chunk ahead
    spent = sum(cost.prefill_seconds(tokens, 40) for tokens in chunks)
    assert spent <= PREFILL_SHARE * 2.0 * steps + cost.prefill_seconds(16, 40), (chunks, steps)
    assert len(chunks) >= 7 and steps >= 4 * len(chunks), (chunks, steps)  # without the policy: 8 steps in a row
    while engine.busy():
        for seq, token, _ in engine.step():
            tokens.setdefault(id(seq), []).append(token)
    for prompt, seq, sampling in zip(ps, [decoding, *long], [steady, short, short, short]):
        assert tokens[id(seq)] == decode_alone(model, tokenizer, prompt, sampling)


@pytest.mark.quick
def test_one_draw_for_many_rows_gives_each_row_its_own_draw():
    """Rows sampled in one pass, each from its own generator, draw the tokens they draw one by one (ties included),
    under every kind of truncation."""
    from nanochat.engine import sample_next_tokens

    for trial in range(40):
        torch.manual_seed(trial)
        rows = 1 + trial % 13
        logits = torch.randn(rows, 97) * (1 + trial % 4)
        if trial % 3 == 0:
            logits = logits.round()  # ties at the top-k boundary
        settings = [(0.6, 50, None), (1.0, None, 0.9), (0.8, 20, 0.5), (1.3, None, None)][trial % 4]
        one_by_one = [int(sample_next_tokens(logits[i:i + 1], torch.Generator().manual_seed(i), *settings))
                      for i in range(rows)]
        generators = [torch.Generator().manual_seed(i) for i in range(rows)]
        assert sample_next_tokens(logits, generators, *settings).tolist() == one_by_one


@pytest.mark.quick
def test_a_decode_step_is_measured_and_leaves_the_engine_as_it_was(tokenizer):  # noqa: F811
    """measure_decode_cost times stand-in steps (a row, several rows, several at half the context) and leaves no trace:
    every row free and empty, no step counted, and what is decoded after is what a fresh engine decodes."""
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=256, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2,
                       n_embd=32)
    small = build_model(config, "cpu").eval()
    engine = BatchEngine(small, tokenizer, max_batch=8)
    cost = measure_decode_cost(engine, repeats=2)
    assert cost.fixed > 0 and cost.per_row >= 0 and cost.per_row_key >= 0, cost
    assert cost.seconds(8, 129) >= cost.seconds(1, 33) and "a decode step" in cost.summary()
    assert not engine.busy() and sorted(engine.free_rows) == list(range(8)) and engine.cache.lengths == [0] * 8
    assert engine.decode_steps == engine.shared_steps == 0 and engine.row_policy is None
    prompt, greedy = prompts(tokenizer, [9])[0], Sampling(temperature=0.0, max_tokens=10)
    after, _, _ = run(engine, {0: [(prompt, greedy)]})
    fresh, _, _ = run(BatchEngine(small, tokenizer, max_batch=8), {0: [(prompt, greedy)]})
    assert list(after.values()) == list(fresh.values())
    engine.add(prompt, greedy)
    with pytest.raises(RuntimeError, match="before adding sequences"):
        measure_decode_cost(engine)
