"""
nanochat/kernels/decode_dtype.py: a CPU decodes in fp32 or bf16, whichever a stand-in of the model's shape decodes
faster (bf16 only when clearly faster), chosen before the model loads; the user's NANOCHAT_DTYPE, a GPU, and a CPU
without native bf16 keep their dtype without a measurement.
"""

import os

import pytest
import torch

from nanochat.gpt import GPTConfig
from nanochat.kernels import decode_dtype
from nanochat.kernels.decode_dtype import stand_in_engine, time_decode_dtypes, use_fastest_decode_dtype
from nanochat.kernels.int8 import Int8Linear
from nanochat.tokenizer import get_tokenizer

CONFIG = GPTConfig(sequence_len=128, vocab_size=1024, n_layer=6, n_head=2, n_kv_head=2, n_embd=64, value_embeds=True)


@pytest.fixture
def tokenizer(tiny_env):
    return get_tokenizer()


@pytest.fixture
def unset_dtype(monkeypatch):
    """No NANOCHAT_DTYPE (conftest sets float32), on a CPU with native bf16: the choice is this module's to make."""
    monkeypatch.delenv("NANOCHAT_DTYPE")
    monkeypatch.setattr(decode_dtype, "has_fast_bf16", lambda device: True)


def timings(monkeypatch, fp32, bf16):
    """time_decode_dtypes answering these seconds, and the calls it got."""
    calls = []

    def timed(config, tokenizer, rows=(1,), int8=False):
        calls.append((rows, int8))
        return {torch.float32: fp32, torch.bfloat16: bf16}

    monkeypatch.setattr(decode_dtype, "time_decode_dtypes", timed)
    return calls


@pytest.mark.quick
def test_the_faster_dtype_is_chosen_and_bf16_only_when_clearly_faster(monkeypatch, unset_dtype, capsys):
    calls = timings(monkeypatch, fp32=0.6e-3, bf16=2.0e-3)  # the Xeon with AMX's d4
    assert use_fastest_decode_dtype("cpu", CONFIG, None, rows=(1, 8), int8=True) == torch.float32
    assert os.environ["NANOCHAT_DTYPE"] == "float32" and calls == [((1, 8), True)]
    assert "decoding in float32: a step of this model's shape took 0.60 ms in float32, 2.00 ms in bfloat16" in \
        capsys.readouterr().out
    monkeypatch.delenv("NANOCHAT_DTYPE")
    timings(monkeypatch, fp32=1.0e-3, bf16=0.5e-3)
    assert use_fastest_decode_dtype("cpu", CONFIG, None) == torch.bfloat16
    assert os.environ["NANOCHAT_DTYPE"] == "bfloat16"
    monkeypatch.delenv("NANOCHAT_DTYPE")
    timings(monkeypatch, fp32=1.0e-3, bf16=0.95e-3)  # within the noise: fp32, never slower and exact
    said, _ = [], capsys.readouterr()  # chat_cli's line goes to stderr: its stdout is the reply alone
    assert use_fastest_decode_dtype("cpu", CONFIG, None, say=said.append) == torch.float32
    assert len(said) == 1 and said[0].startswith("decoding in float32") and capsys.readouterr().out == ""


@pytest.mark.quick
def test_the_users_dtype_a_cpu_without_bf16_and_a_gpu_are_not_measured(monkeypatch):
    calls = timings(monkeypatch, fp32=1.0, bf16=0.1)
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    assert use_fastest_decode_dtype("cpu", CONFIG, None) == torch.bfloat16
    monkeypatch.delenv("NANOCHAT_DTYPE")
    monkeypatch.setattr(decode_dtype, "has_fast_bf16", lambda device: False)
    assert use_fastest_decode_dtype("cpu", CONFIG, None) == torch.float32
    assert "NANOCHAT_DTYPE" not in os.environ
    monkeypatch.setattr(decode_dtype, "get_compute_dtype", lambda device: torch.bfloat16)
    assert use_fastest_decode_dtype("cuda", CONFIG, None) == torch.bfloat16
    assert calls == []


def test_stand_ins_decode_in_each_dtype_and_leave_the_environment_alone(tokenizer, unset_dtype, single_torch_thread):
    """The stand-in is the model's shape (at most STAND_IN_LAYERS blocks) prepared as chat_cli prepares it, in the
    dtype being timed, int8 if asked; the timing gives each dtype a step time and sets nothing."""
    fp32, bf16 = (stand_in_engine(CONFIG, tokenizer, dtype, rows=2) for dtype in (torch.float32, torch.bfloat16))
    assert len(fp32.model.transformer.h) == decode_dtype.STAND_IN_LAYERS and fp32.model.config.n_embd == 64
    assert fp32.model.lm_head.weight.dtype == torch.float32 and bf16.model.lm_head.weight.dtype == torch.bfloat16
    assert fp32.autocast().__class__.__name__ == "nullcontext" and isinstance(bf16.autocast(), torch.autocast)
    assert [seq.generated for seq in fp32.running] == [decode_dtype.STEPS + 1] * 2  # two rows decoding, none ended
    int8 = stand_in_engine(CONFIG, tokenizer, torch.float32, rows=1, int8=True)
    assert isinstance(int8.model.lm_head, Int8Linear)
    seconds = time_decode_dtypes(CONFIG, tokenizer, rows=(1, 2))
    assert set(seconds) == {torch.float32, torch.bfloat16} and all(0 < s < 1 for s in seconds.values())
    assert "NANOCHAT_DTYPE" not in os.environ


@pytest.mark.quick
def test_chat_webs_measurement_runs_on_one_thread_where_it_forks(tiny_base_dir, tmp_path, monkeypatch):
    """chat_web times the dtypes before it starts its workers: on the threads they will have where they are spawned, on
    one where this process forks them (a child of a process whose OpenMP team had more threads hangs: libgomp)."""
    from test_chat_cli import build_chat_checkpoint

    from nanochat.serving import workers

    build_chat_checkpoint(tiny_base_dir, tmp_path / "base", 64)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    seen = []

    class Measured(Exception):
        pass

    def measure(device, config, tokenizer, rows=(1,), int8=False):
        seen.append((torch.get_num_threads(), rows, int8, config["n_embd"]))
        raise Measured  # no worker started: what was asked is all this test wants

    monkeypatch.setattr(workers, "use_fastest_decode_dtype", measure)
    previous = torch.get_num_threads()
    try:
        for start_method in ("fork", "spawn"):
            with pytest.raises(Measured):
                workers.load_workers("sft", None, None, "cpu", 1, 64, threads=2, start_method=start_method, int8=True)
    finally:
        torch.set_num_threads(previous)
    assert seen == [(1, [1, 8], True, 64), (2, [1, 8], True, 64)]
