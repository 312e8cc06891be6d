"""
nanochat where POSIX's own modules are missing, as on Windows: no fcntl, termios, resource, pwd or grp. The stages and
chat_web must import and run there, a checkpoint directory must still refuse a second writer, and the fallbacks must
keep Linux's behaviour where it has the modules. The subprocess tests hide the modules with a sitecustomize on
PYTHONPATH, before anything of nanochat's is imported.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from test_base_train import TINY, env_for, fresh_base

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSIX_ONLY = ("fcntl", "termios", "resource", "pwd", "grp")
# Imported before the modules are hidden: Linux's psutil is built on resource, Windows' on its own code, so psutil
# works on both; the modules are then dropped from sys.modules and refused by a finder, for everything after.
HIDING = textwrap.dedent(f"""
    import sys
    import psutil
    POSIX_ONLY = {POSIX_ONLY!r}

    class Hidden:
        def find_spec(self, name, path=None, target=None):
            if name in POSIX_ONLY:
                raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)

    for name in POSIX_ONLY:
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, Hidden())
""")
STAGES = ["tok_train", "tok_eval", "base_train", "base_loss", "base_eval", "mid_train", "chat_sft", "chat_rl",
          "chat_eval", "chat_cli", "chat_web"]


def hidden_python(tmp_path, base, code):
    """A Python process running `code` with POSIX's own modules hidden, output line by line."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDING)
    env = dict(env_for(base), PYTHONPATH=os.pathsep.join([str(site), REPO_ROOT]))
    return subprocess.Popen([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def line_of(proc, prefix):
    """The process's next line starting with prefix; what it printed, if it ended first."""
    seen = []
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
        seen.append(line)
    raise AssertionError(f"the process ended (exit code {proc.wait()}) before a line {prefix!r}:\n"
                         + "".join(seen[-40:]))


def test_without_posix_modules_the_stages_and_chat_web_import_train_and_refuse_a_second_writer(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "noposix")
    flags = TINY + ["--eval-every=-1", "--num-iterations=2"]
    holder = hidden_python(tmp_path, base, f"""
        import importlib
        try:
            import fcntl
            print("fcntl imported")
        except ImportError:
            print("no fcntl")
        for stage in {STAGES!r}:
            importlib.import_module("scripts." + stage)
        print("imported every stage and chat_web", flush=True)
        from nanochat import checkpoint_manager
        from scripts import base_train
        base_train.main({flags!r})  # claims the tag, trains, saves; the claim lasts as long as this process
        print("holding with", type(checkpoint_manager._claims[0]).__name__, checkpoint_manager.list_steps(
              checkpoint_manager.checkpoint_dir("base", "tiny")), flush=True)
        input()
    """)
    try:
        assert line_of(holder, "no fcntl") == "no fcntl"
        assert line_of(holder, "imported") == "imported every stage and chat_web"
        # the lock filelock falls back to without fcntl, and the checkpoint the run saved under it
        assert line_of(holder, "holding") == "holding with SoftFileLock [2]"
        second = hidden_python(tmp_path, base, f"""
            from nanochat.checkpoint_manager import checkpoint_dir, claim_checkpoint_dir
            from nanochat.common import UserError
            from scripts import base_train
            try:
                base_train.main({flags!r})
                print("refused: no, it trained")
            except UserError as e:
                print("refused:", e, flush=True)
            input()  # the holder is killed meanwhile: its lock goes with it
            claim_checkpoint_dir(checkpoint_dir("base", "tiny"))
            print("claimed after the holder died", flush=True)
        """)
        try:
            refusal = line_of(second, "refused")
            assert "is in use by another run" in refusal and f"pid {holder.pid} on " in refusal, refusal
            holder.send_signal(signal.SIGKILL)  # no release: the lock file stays, naming a process that is gone
            holder.wait(timeout=60)
            second.stdin.write("\n")
            second.stdin.flush()
            assert line_of(second, "claimed") == "claimed after the holder died"
        finally:
            second.kill()
            second.wait(timeout=60)
    finally:
        holder.kill()
        holder.wait(timeout=60)


@pytest.mark.quick
def test_chat_webs_start_needs_no_open_file_limit_and_no_fork_hook(monkeypatch):
    """Windows has no RLIMIT_NOFILE to raise and no os.register_at_fork: chat_web's start takes a connection bound a
    system of handles allows, and binds its socket all the same."""
    from nanochat.serving import guards

    assert guards.raise_open_file_limit() > 0  # Linux: the real limit, raised
    monkeypatch.setattr(guards, "resource", None)
    assert guards.raise_open_file_limit() == guards.UNLIMITED_OPEN_FILES
    assert guards.default_max_connections(guards.UNLIMITED_OPEN_FILES) == 4096
    monkeypatch.delattr(os, "register_at_fork")
    sock = guards.bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


@pytest.mark.quick
def test_peak_memory_without_resource_is_psutils(monkeypatch):
    """The training loop's peak memory on a CPU: getrusage's where the system has it, else psutil's (the peak working
    set on Windows; here, without that field, the resident size, which is at most the peak)."""
    import resource

    import psutil

    from nanochat.common import peak_memory_mib

    psutil.Process().memory_info()  # Linux's psutil loads its resource-based part now, as in HIDING

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peak_memory_mib("cpu") == pytest.approx(peak, rel=0.05)
    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` now raises ImportError
    assert 0 < peak_memory_mib("cpu") <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 * 1.01


def test_workers_pipes_read_in_a_thread_as_on_windows(tiny_base_dir, tmp_path, monkeypatch, capfd):
    """Windows' event loops cannot watch a pipe: there a thread reads each worker's (READ_IN_THREAD). Forced here, a
    request is answered through it, a worker stopped with the server is not reported lost, and a killed one fails the
    request it held."""
    import asyncio

    from test_chat_cli import build_chat_checkpoint

    from nanochat.engine import Sampling
    from nanochat.serving import workers
    from nanochat.serving.chat import Failure, Finish

    base = tmp_path / "base"
    tokenizer = build_chat_checkpoint(tiny_base_dir, base, 64)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setattr(workers, "READ_IN_THREAD", True)
    prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "Hello"}]})

    async def reply(pool, max_tokens, kill=False):
        generation = await pool.submit(prompt, Sampling(temperature=0.0, max_tokens=max_tokens))
        if kill:
            generation.worker.process.kill()
        return [e async for batch in generation.event_batches() for e in batch]

    async def serve(kill):
        (worker,), _, _ = workers.load_workers("sft", None, None, "cpu", 1, 1, threads=1)
        pool = workers.WorkerPool([worker], queue_timeout=30)
        pool.start()
        try:
            events = await asyncio.wait_for(reply(pool, 40 if kill else 5, kill), 30)
        finally:
            pool.stop()
            await asyncio.sleep(0.2)  # the receiving thread's report of the pipe's end, if any, runs now
        return worker, events

    worker, events = asyncio.run(serve(kill=False))
    assert next(e for e in events if isinstance(e, Finish)).completion_tokens == 5
    assert worker.process.exitcode == 0 and "exited" not in capfd.readouterr().out
    worker, events = asyncio.run(serve(kill=True))
    assert any(isinstance(e, Failure) and "worker 0 exited" in e.reason for e in events), events
    assert not worker.alive
