"""
What a real user does to a run, done for real: stop it through a launcher, start a second run on the same tag,
mistype a flag, resume with other flags, point it at a read-only or full disk, damage a checkpoint directory,
serve a wrong eval bundle. Each ends in a saved state or a one-line reason, never a traceback or a lost run.
"""

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_base_train import TINY, env_for, fresh_base, run_train, train_cmd

from nanochat.checkpoint_manager import list_steps

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(cmd, base, extra_env=None):
    env = env_for(base)
    env.update(extra_env or {})
    return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def read_until(proc, marker, lines, timeout=180, stream="stdout"):
    deadline = time.time() + timeout
    for line in getattr(proc, stream):
        lines.append(line)
        if marker in line:
            return
        assert time.time() < deadline, f"never saw {marker!r}:\n" + "".join(lines[-30:])
    raise AssertionError(f"process ended before {marker!r}:\n" + "".join(lines[-30:]))


def finish(proc, lines, timeout=180):
    out, _ = proc.communicate(timeout=timeout)
    lines.append(out)
    return "".join(lines)


def ckpt_dir(base, tag="tiny"):
    return os.path.join(base, "base_checkpoints", tag)


# -----------------------------------------------------------------------------
# 1. A stop through the launcher saves once and exits cleanly


def test_group_sigterm_through_uv_run_saves_and_exits_zero(tiny_base_dir, tmp_path):
    # `timeout`, systemd, Slurm and a closing terminal signal the whole process group; uv forwards a second copy.
    uv = shutil.which("uv")
    assert uv, "uv must be on PATH (the README's test command installs it)"
    base = fresh_base(tiny_base_dir, tmp_path, "uvrun")
    proc = start([uv, "run", "--no-sync", "python", "-m", "scripts.base_train"] + TINY +
                 ["--num-iterations=100000", "--eval-every=-1"], base)
    lines = []
    read_until(proc, "step 00003/", lines)
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc, lines)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    steps = list_steps(ckpt_dir(base))
    assert len(steps) == 1 and steps[0] >= 3
    assert out.count("saved checkpoint step") == 1


@pytest.mark.slow  # 12 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_group_sigterm_under_torchrun_saves_every_rank_once(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "trun")
    proc = start(train_cmd(2) + TINY + ["--num-iterations=100000", "--eval-every=-1"], base)
    lines = []
    read_until(proc, "step 00003/", lines)
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc, lines)
    steps = list_steps(ckpt_dir(base))
    assert len(steps) == 1, out[-3000:]
    step_dir = os.path.join(ckpt_dir(base), f"step_{steps[0]:06d}")
    assert {"optim_rank0.safetensors", "optim_rank1.safetensors", "model.safetensors"} <= set(os.listdir(step_dir))
    assert out.count("saved checkpoint step") == 1 and "stop requested" in out and "KeyboardInterrupt" not in out
    # torchrun's agent reports the signal it got with a traceback of its own; none may come from our code
    for traceback in out.split("Traceback")[1:]:
        assert "SignalException" in traceback and "nanochat/" not in traceback and "scripts/" not in traceback
    # and the run continues from it
    p = run_train(base, ["--num-iterations=" + str(steps[0] + 2), "--eval-every=-1", "--resume"], nproc=2)
    assert f"resuming at step {steps[0]}" in p.stdout
    # A fresh run this short would train hotter (short_run_lr_scale); the continuation keeps the checkpoint's lrs.
    assert "lrs kept from the checkpoint" in p.stdout

    def initial_lrs(step):
        with open(os.path.join(ckpt_dir(base), f"step_{step:06d}", "optim_rank0.json")) as f:
            return [group["initial_lr"] for opt in json.load(f) for group in opt["param_groups"]]
    assert initial_lrs(steps[0] + 2) == initial_lrs(steps[0])


@pytest.mark.slow  # 12 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_one_rank_failing_stops_every_rank_with_its_message(tiny_base_dir, tmp_path):
    # Two "nodes" (torchrun launches joined by c10d rendezvous), one rank each. Rank 1 cannot write its optimizer shard
    # (a full disk), then takes 5 s to end its process, during which its peer gets no error from the process group:
    # rank 0 sits in the checkpoint's barrier on the other node. It must not wait that out.
    import psutil
    from test_base_train import free_port

    base = fresh_base(tiny_base_dir, tmp_path, "rankfail")
    fault = os.path.join(REPO_ROOT, "tests", "rank_fault.py")
    args = ["--num-iterations=8", "--save-every=2", "--eval-every=-1"]
    cause = f"could not write checkpoint step 4 to {ckpt_dir(base)} (No space left on device)"
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rankfail", fault,
                               "checkpoint@4+linger"] + TINY + args, env=env_for(base), cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    lines = []  # (seconds since start, line) of both launches, in the order they arrive
    readers = [threading.Thread(target=lambda node=node: lines.extend((time.time(), line) for line in node.stderr))
               for node in nodes]
    for reader in readers:
        reader.start()
    deadline = time.time() + 60
    try:  # c10d may give either launch rank 0
        while not any("stopping rank" in line for _, line in lines) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        for node in nodes:  # the whole tree: torchrun's workers outlive a kill of its process group
            for process in [*psutil.Process(node.pid).children(recursive=True), psutil.Process(node.pid)]:
                process.kill()
            node.wait(timeout=60)
        for reader in readers:
            reader.join(timeout=60)
    text = "".join(line for _, line in lines)
    stopped = next((t for t, line in lines if "stopping rank" in line), None)
    assert stopped, text[-3000:]
    assert f"error: rank 1 failed: {cause}; the previous checkpoint (step 2) is intact. Free some space, then --resume; " \
           "stopping rank 0 too\n" in text, text[-3000:]
    assert f"error: {cause}" in text  # rank 1's own line
    assert not [t for t, line in lines if "rank 1 process ends" in line and t < stopped]  # rank 0 did not wait for it
    assert list_steps(ckpt_dir(base)) == [2]
    # an unexpected exception: its traceback on the rank that raised, one line on the others
    shutil.rmtree(ckpt_dir(base))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", fault,
                        "raise@3"] + TINY + args, env=env_for(base), cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=60)
    assert "[rank1]: RuntimeError: injected failure in step 3" in p.stderr, p.stderr[-3000:]
    assert "error: rank 1 failed: RuntimeError: injected failure in step 3; stopping rank 0 too" in p.stderr
    assert "[rank0]:" not in p.stderr and p.returncode != 0


def out_of_memory_lines(monkeypatch, capsys, main, argv, after=0):
    """Run a stage's main() in this process with every forward after the first `after` out of memory, as on a GPU when a
    micro-batch does not fit: it must exit 1; returns its stderr lines."""
    import torch

    from nanochat.common import run_main
    from nanochat.gpt import GPT

    calls, real = [0], getattr(GPT.forward, "real", GPT.forward)  # not an earlier call's stand-in

    def forward(self, idx, *args, **kwargs):
        calls[0] += 1
        if calls[0] <= after:
            return real(self, idx, *args, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of ...")

    forward.real = real
    monkeypatch.setattr(GPT, "forward", forward)
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: main(argv))
    assert exit_info.value.code == 1
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.quick
def test_out_of_memory_names_the_stage_and_the_batch_to_try(tiny_base_dir, tmp_path, monkeypatch, capsys):
    import torch

    from nanochat.common import is_out_of_memory
    from scripts import base_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", fresh_base(tiny_base_dir, tmp_path, "oom"))
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    # after the first steps (which halve the device batch instead: loop.FittingBatches), the stage and what to try
    for batch, expected in ((6, "try --device-batch-size=3; gradient accumulation keeps the global batch "
                                "(--total-batch-size=768) with 2x the micro-steps per optimizer step"),
                            (1, "--device-batch-size is 1 already; try a shorter --max-seq-len, a smaller --depth, or "
                                "more GPUs")):
        argv = TINY + ["--num-iterations=6", "--eval-every=-1", f"--device-batch-size={batch}",
                       f"--total-batch-size={batch * 128}", f"--model-tag=oom{batch}"]
        lines = out_of_memory_lines(monkeypatch, capsys, base_train.main, argv, after=3 * 2)
        assert lines == [f"error: out of memory in base_train (depth 2, --device-batch-size={batch}): {expected}"], lines
    # in the first steps, down to one row, then the depth and the memory in one line
    argv = TINY + ["--num-iterations=6", "--eval-every=-1", "--device-batch-size=4", "--total-batch-size=512",
                   "--model-tag=oom-first"]
    lines = out_of_memory_lines(monkeypatch, capsys, base_train.main, argv)
    assert lines == ["error: d2 does not fit in the cpu's memory even at --device-batch-size=1 (rows of 64 tokens): "
                     "train a smaller --depth or a shorter --max-seq-len, or use a device with more memory"], lines
    # the CPU's own allocation failure is a RuntimeError, recognised as running out of memory too
    with pytest.raises(RuntimeError) as error:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_out_of_memory(error.value)


# -----------------------------------------------------------------------------
# 2. One run per model tag; one download per shard


def test_second_run_on_the_same_tag_is_refused_and_a_killed_holder_releases_it(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "lock")
    first = start(train_cmd() + TINY + ["--num-iterations=100000", "--eval-every=-1"], base)
    lines = []
    read_until(first, "step 00001/", lines)
    second = run_train(base, ["--num-iterations=3", "--eval-every=-1"], check=False)
    assert second.returncode == 1 and "in use by another run" in second.stderr
    assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    third = run_train(base, ["--num-iterations=3", "--eval-every=-1"])  # the kernel dropped the dead holder's lock
    assert "done: 3/3" in third.stdout


class SlowShardServer:
    """Serves fineweb-edu shard files, slowly, and counts requests per file."""

    def __init__(self, files):
        self.files, self.count = files, {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                server.count[name] = server.count.get(name, 0) + 1
                data = server.files.get(name)
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                half = len(data) // 2
                self.wfile.write(data[:half])
                time.sleep(1.0)  # long enough for a second downloader to arrive mid-file
                self.wfile.write(data[half:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def parquet_bytes(texts):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buffer)
    return buffer.getvalue()


def test_two_concurrent_downloads_of_one_shard_fetch_it_once(tmp_path):
    files = {"shard_00000.parquet": parquet_bytes(["a"] * 2000), "shard_01822.parquet": parquet_bytes(["v"] * 10)}
    server = SlowShardServer(files)
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path), HF_ENDPOINT=server.url, NO_PROXY="127.0.0.1")
    cmd = [sys.executable, "-m", "nanochat.dataset", "-n", "1", "--data-source", "fineweb-edu"]
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    server.httpd.shutdown()
    assert all(p.returncode == 0 for p in procs), outs
    assert server.count == {"shard_00000.parquet": 1, "shard_01822.parquet": 1}
    data_dir = tmp_path / "base_data" / "fineweb-edu"
    assert (data_dir / "shard_00000.parquet").read_bytes() == files["shard_00000.parquet"]
    assert not [n for n in os.listdir(data_dir) if ".tmp" in n]


# -----------------------------------------------------------------------------
# 3. Every flag checked before compute


@pytest.mark.quick
@pytest.mark.parametrize("flag, says", [
    ("--max-seq-len=0", "--max-seq-len=0"), ("--max-seq-len=1", "--max-seq-len=1"), ("--head-dim=0", "--head-dim=0"),
    ("--head-dim=-8", "--head-dim=-8"), ("--aspect-ratio=0", "--aspect-ratio=0"), ("--num-kv-heads=-1", "--num-kv-heads=-1"),
    ("--num-kv-heads=3", "--num-kv-heads=3"), ("--head-dim=33", "--head-dim"), ("--matrix-lr=0", "--matrix-lr=0"),
    ("--embedding-lr=-0.5", "--embedding-lr=-0.5"), ("--unembedding-lr=0", "--unembedding-lr=0"),
    ("--weight-decay=-2", "--weight-decay=-2"), ("--warmup-ratio=1.5", "--warmup-ratio=1.5"),
    ("--warmdown-ratio=-0.1", "--warmdown-ratio=-0.1"), ("--keep-last=0", "--keep-last=0"),
    ("--num-iterations=0", "--num-iterations=0"), ("--eval-every=0", "--eval-every=0"), ("--grad-clip=-1", "--grad-clip=-1"),
    ("--device-batch-size=0", "--device-batch-size=0"), ("--total-batch-size=300", "--total-batch-size=300"),
    ("--model-tag=../escape", "model tag '../escape'"), ("--device-type=tpu", "--device-type"),
])
def test_bad_flag_gives_one_line_before_compute(tiny_base_dir, monkeypatch, capsys, flag, says):
    # In-process for speed (each case would otherwise pay a torch import); the process boundary is exercised below.
    from nanochat.common import run_main
    from scripts import base_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    monkeypatch.setattr(base_train, "build_model", lambda *a, **k: pytest.fail(f"{flag} reached the model build"))
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: base_train.main(TINY + ["--num-iterations=2", flag]))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err


def test_bad_flag_in_a_real_process_exits_1_with_no_traceback(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "flags")
    for flag in ("--num-iterations=0", "--max-seq-len=1"):
        p = subprocess.run(train_cmd() + TINY + [flag], env=env_for(base), capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and p.stderr.startswith("error: --") and p.stderr.count("\n") == 1, p.stderr
        assert "step 0" not in p.stdout


# -----------------------------------------------------------------------------
# 4. Resume with changed flags


@pytest.mark.slow  # 22 s; exact resume itself is in the default run (test_base_train, test_chat_stages)
def test_resume_extends_the_budget_and_refuses_changes_that_break_exactness(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "extend")
    run_train(base, ["--num-iterations=5", "--eval-every=-1"])
    p = run_train(base, ["--num-iterations=8", "--eval-every=-1", "--resume"])
    assert "--num-iterations 5 -> 8" in p.stdout and "done: 8/8" in p.stdout
    assert list_steps(ckpt_dir(base))[-1] == 8
    p = run_train(base, ["--num-iterations=10", "--eval-every=-1", "--resume", "--device-batch-size=4"], check=False)
    assert p.returncode == 1 and "--device-batch-size 2 -> 4" in p.stderr
    p = run_train(base, ["--num-iterations=10", "--eval-every=-1", "--resume", "--total-batch-size=512"], check=False)
    assert p.returncode == 1 and "--total-batch-size 256 -> 512" in p.stderr
    p = run_train(base, ["--eval-every=-1", "--resume"])  # no budget given: the checkpoint's run is complete
    assert "done: 8/8" in p.stdout
    # more ranks than wrote the checkpoint: every rank says why, none looks for an optimizer shard that never existed
    p = run_train(base, ["--num-iterations=10", "--eval-every=-1", "--resume"], nproc=2, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and out.count("was written by 1 ranks; resume with the same number of ranks") == 2, out[-3000:]
    assert "optim_rank1" not in out and list_steps(ckpt_dir(base))[-1] == 8
    # a fresh run may not mix its checkpoints with the earlier run's: its step 3 would hide behind their step 8
    p = run_train(base, ["--num-iterations=3", "--eval-every=-1"], check=False)
    assert p.returncode == 1 and "already holds checkpoints of an earlier run (steps" in p.stderr


# -----------------------------------------------------------------------------
# 5. Read-only and full disks


def read_only_command(path, cmd):
    """Run cmd with `path` bind-mounted read-only, in a private user + mount namespace (no root needed)."""
    assert shutil.which("unshare"), "unshare (util-linux) is needed for the read-only mount"
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, path] + cmd


def test_read_only_base_dir_fails_before_any_work(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "ro")
    for cmd in ([sys.executable, "-m", "scripts.tok_train", "--max-chars=100000", "--vocab-size=300"],
                [sys.executable, "-m", "scripts.tok_eval"], train_cmd() + TINY + ["--num-iterations=2"]):
        p = subprocess.run(read_only_command(base, cmd), env=env_for(base), cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 1, p.stderr[-2000:]
        assert "cannot write" in p.stderr and "Read-only file system" in p.stderr and "Traceback" not in p.stderr
        assert "trained on" not in p.stdout and "step 0" not in p.stdout


@pytest.mark.slow  # 12 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tiny_base_dir, tmp_path):
    import resource

    base = fresh_base(tiny_base_dir, tmp_path, "full")
    run_train(base, ["--num-iterations=2", "--eval-every=-1"])

    def small_disk():  # files may not grow past 64 KB: the next checkpoint cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    p = subprocess.run(train_cmd() + TINY + ["--num-iterations=4", "--eval-every=-1", "--resume"], env=env_for(base),
                       capture_output=True, text=True, timeout=120, preexec_fn=small_disk)
    assert p.returncode == 1 and "could not write checkpoint step 4" in p.stderr, p.stderr[-2000:]
    assert "previous checkpoint (step 2) is intact" in p.stderr and "Traceback" not in p.stderr
    assert list_steps(ckpt_dir(base)) == [2] and not os.path.exists(os.path.join(ckpt_dir(base), ".tmp_step_000004"))
    assert "resuming at step 2" in run_train(base, ["--num-iterations=4", "--eval-every=-1", "--resume"]).stdout


# -----------------------------------------------------------------------------
# 6. Damaged checkpoint directories


@pytest.mark.slow  # 15 s; a corrupt checkpoint file is refused in the default run (test_base_train)
def test_damaged_step_dirs_are_named_and_skipped(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "damaged")
    run_train(base, ["--num-iterations=4", "--eval-every=-1", "--save-every=2", "--keep-last=5"])
    pristine = str(tmp_path / "pristine")
    shutil.copytree(ckpt_dir(base), pristine)
    meta_path = os.path.join(ckpt_dir(base), "step_000004", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    damaged = {"no meta": None, "no file list": {k: v for k, v in meta.items() if k != "files"},
               "unknown config key": dict(meta, model_config=dict(meta["model_config"], rope_scaling=2))}
    for damage, new_meta in damaged.items():
        shutil.rmtree(ckpt_dir(base))
        shutil.copytree(pristine, ckpt_dir(base))
        if new_meta is None:
            os.remove(meta_path)
        else:
            with open(meta_path, "w") as f:
                json.dump(new_meta, f)
        p = run_train(base, ["--num-iterations=4", "--eval-every=-1", "--resume"])
        assert "warning: skipping checkpoint" in p.stdout and "step_000004" in p.stdout, damage
        assert "resuming at step 2" in p.stdout, damage


# -----------------------------------------------------------------------------
# 7. The eval bundle


def test_eval_bundle_with_wrong_hash_or_escaping_paths_is_refused(tmp_path, monkeypatch):
    import zipfile

    from nanochat import core_eval
    from nanochat.common import UserError

    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    www = tmp_path / "www"
    www.mkdir()
    with zipfile.ZipFile(www / "bundle.zip", "w") as zf:
        zf.writestr("eval_bundle/core.yaml", "icl_tasks:\n- {label: t, dataset_uri: ../../../etc/hostname, "
                    "icl_task_type: language_modeling}\n")
        zf.writestr("eval_bundle/eval_meta_data.csv", "Eval Task,Random baseline\nt,0\n")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(www), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"http://127.0.0.1:{httpd.server_address[1]}/bundle.zip")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    try:
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", "0" * 64)
        with pytest.raises(UserError, match="sha256 mismatch"):
            core_eval.ensure_eval_bundle()
        assert not (base / "eval_bundle").exists()
        monkeypatch.setattr(core_eval, "EVAL_BUNDLE_MAX_BYTES", 100)
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", "none")
        with pytest.raises(UserError, match="more than the 100"):
            core_eval.ensure_eval_bundle()
        monkeypatch.setattr(core_eval, "EVAL_BUNDLE_MAX_BYTES", 10**6)
        bundle_dir = core_eval.ensure_eval_bundle()
        with pytest.raises(UserError, match="outside the bundle folder"):
            core_eval.load_core_tasks(bundle_dir)
    finally:
        httpd.shutdown()


@pytest.mark.quick
def test_torch_floor_excludes_versions_whose_safe_loading_is_bypassable():
    """Checkpoints and imports are read with torch.load(weights_only=True), which torch below 2.6 (CVE-2025-32434) and
    below 2.10 (CVE-2026-24747) let a crafted file bypass: the project must not allow those versions."""
    import re

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")) as f:
        floor = re.search(r'"torch>=(\d+)\.(\d+)', f.read())
    assert floor and (int(floor.group(1)), int(floor.group(2))) >= (2, 10)
    import torch

    assert tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 10)
