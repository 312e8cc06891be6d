"""Tests for nanochat.execution: outcomes, timeout, memory limit, isolation, the disabled destructive calls, and tests
run against a candidate's code in a process of their own (the attacks on the OS layer are in test_sandbox.py)."""

import ast
import os
import subprocess
import sys
import time

import pytest

from nanochat.execution import ExecutionResult, execute_code, execute_tests


@pytest.mark.quick
def test_success_captures_stdout_and_stderr():
    result = execute_code("import sys\nprint('hello', 6 * 7)\nprint('careful', file=sys.stderr)")
    assert result == ExecutionResult(success=True, stdout="hello 42\n", stderr="careful\n")


@pytest.mark.quick
def test_exception_reports_its_type_and_message():
    result = execute_code("print('before')\n1 / 0\nprint('after')")
    assert not result.success and not result.timeout and not result.memory_exceeded
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.stdout == "before\n"
    assert "ZeroDivisionError" in result.stderr


@pytest.mark.quick
@pytest.mark.parametrize("code, error_type", [
    ("def f(:\n    pass", "SyntaxError"),
    ("assert 1 + 1 == 3", "AssertionError"),
    ("import sys\nsys.exit(0)\nprint('unreachable')", "SystemExit"),  # exiting early is not running to the end
])
def test_code_that_does_not_run_to_its_end_fails(code, error_type):
    result = execute_code(code)
    assert not result.success
    assert result.error.split(":")[0] == error_type
    assert "unreachable" not in result.stdout


@pytest.mark.quick
def test_exit_without_report_fails():
    result = execute_code("import os\nos._exit(0)")
    assert not result.success
    assert "before the code finished" in result.error


@pytest.mark.quick
def test_infinite_loop_times_out_promptly():
    start = time.monotonic()
    result = execute_code("print('started')\nwhile True:\n    pass", timeout=1.0)
    elapsed = time.monotonic() - start
    assert result.timeout and not result.success
    assert result.error.startswith("TimeoutError")
    assert result.stdout == "started\n"  # unbuffered: output before the kill is kept
    assert elapsed < 2.0


@pytest.mark.quick
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is only enforced on Linux")
@pytest.mark.parametrize("allocation", ["x = bytearray(1 << 30)", "x = [0] * (1 << 28)"])
def test_large_allocation_exceeds_memory_limit(allocation):
    result = execute_code(allocation)
    assert result.memory_exceeded and not result.success and not result.timeout
    assert result.error.startswith("MemoryError")


@pytest.mark.quick
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is only enforced on Linux")
def test_memory_limit_is_configurable():
    allocation = "x = bytearray(96 << 20)\nprint(len(x) >> 20)"
    assert execute_code(allocation, maximum_memory_bytes=64 << 20).memory_exceeded
    assert execute_code(allocation, maximum_memory_bytes=None).stdout == "96\n"


@pytest.mark.quick
def test_output_is_capped():
    result = execute_code("import sys\nsys.stdout.write('x' * (3 << 20))\nsys.stderr.write('y' * (3 << 20))")
    assert result.success
    assert result.stdout == "x" * (1 << 20) and result.stderr == "y" * (1 << 20)


@pytest.mark.quick
def test_parent_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("NANOCHAT_SECRET", "hunter2")
    result = execute_code("import os\nprint(dict(os.environ))\nprint(os.environ.get('NANOCHAT_SECRET'))")
    assert result.success
    assert "hunter2" not in result.stdout and "NANOCHAT_SECRET" not in result.stdout
    assert result.stdout.endswith("None\n")


@pytest.mark.quick
def test_input_fails():
    result = execute_code("name = input('name? ')\nprint('got', name)")
    assert not result.success
    assert result.error.startswith("EOFError")
    assert "got" not in result.stdout


@pytest.mark.quick
def test_runs_in_a_fresh_temp_dir_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = "import os\nprint(os.listdir('.'))\nopen('relative.txt', 'w').write('x')\nprint(os.path.realpath(os.getcwd()))"
    result = execute_code(code)
    assert result.success
    listing, sandbox = result.stdout.splitlines()
    assert listing == "[]"  # not even the file the code came in
    assert sandbox != str(tmp_path.resolve())
    assert not os.path.exists(sandbox)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.quick
def test_code_runs_exactly_as_written():
    literal = r"""'''quotes ' " \''' backslashes \\ \n \x41 braces {} {{x}} {0} %s %(name)s unicode ünïcødé ✓ 🚀'''"""
    code = "# -*- coding: latin-1 -*-  (ignored: the code arrives as text)\nprint(" + literal + ", end='')\n"
    result = execute_code(code)
    assert result.success, result.stderr
    assert result.stdout == ast.literal_eval(literal)


@pytest.mark.quick
def test_user_code_sees_fresh_globals():
    code = (
        "import __main__\n"
        "print(sorted(k for k in globals() if not k.startswith('__')))\n"
        "print(__name__, __main__.__dict__ is globals())\n"
    )
    result = execute_code(code)
    assert result.stdout == "[]\n__main__ True\n"


@pytest.mark.quick
def test_code_may_change_files_inside_its_own_dir():
    code = """
import os, pathlib, shutil, tempfile
os.makedirs('a/b')
with open('a/b/f.txt', 'w') as f:
    f.write('hi')
os.rename('a/b/f.txt', 'a/g.txt')
os.chmod('a/g.txt', 0o600)
shutil.rmtree('a')
pathlib.Path('p.txt').write_text('p')
pathlib.Path('p.txt').unlink()
with tempfile.NamedTemporaryFile('w') as f:
    f.write('temporary')
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, 'x'), 'w').close()
print(os.listdir('.'))
"""
    result = execute_code(code)
    assert result.success, result.stderr
    assert result.stdout == "[]\n"


@pytest.fixture
def outside(tmp_path):
    """Files outside the sandbox that the destructive calls aim at, and a live process to aim kill at."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "leaf.txt").write_text("leaf")
    (tmp_path / "empty").mkdir()
    (tmp_path / "keep.txt").write_text("precious")
    mode = (tmp_path / "keep.txt").stat().st_mode
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield {"dir": str(tmp_path), "file": str(tmp_path / "keep.txt"), "tree": str(tmp_path / "tree"),
           "empty": str(tmp_path / "empty"), "victim": victim.pid}
    assert victim.poll() is None, "the sandboxed code killed the victim process"
    victim.kill()
    victim.wait()
    assert (tmp_path / "keep.txt").read_text() == "precious"
    assert (tmp_path / "keep.txt").stat().st_mode == mode
    assert (tmp_path / "tree" / "leaf.txt").read_text() == "leaf"
    assert (tmp_path / "empty").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "keep.txt", "tree"]


DESTRUCTIVE_CALLS = {
    "os.remove": "import os\nos.remove({file!r})",
    "os.unlink": "import os\nos.unlink(path={file!r})",
    "pathlib.unlink": "import pathlib\npathlib.Path({file!r}).unlink()",
    "os.rmdir": "import os\nos.rmdir({empty!r})",
    "os.removedirs": "import os\nos.removedirs({empty!r})",
    "shutil.rmtree": "import shutil\nshutil.rmtree({tree!r})",
    "shutil.rmtree ignore_errors": "import shutil\nshutil.rmtree({tree!r}, ignore_errors=True)",
    "os.rename": "import os\nos.rename({file!r}, 'stolen.txt')",
    "os.replace": "import os\nopen('new.txt', 'w').close()\nos.replace('new.txt', {file!r})",
    "shutil.move": "import shutil\nshutil.move({file!r}, 'stolen.txt')",
    "os.truncate": "import os\nos.truncate({file!r}, 0)",
    "os.chmod": "import os\nos.chmod({file!r}, 0)",
    "open for writing": "open({file!r}, 'w').write('clobbered')",
    "open for appending": "open({file!r}, 'a').write('clobbered')",
    "pathlib.write_text": "import pathlib\npathlib.Path({file!r}).write_text('clobbered')",
    "os.open O_TRUNC": "import os\nos.open({file!r}, os.O_WRONLY | os.O_TRUNC)",
    "os.open O_CREAT": "import os\nos.open({dir!r} + '/new.txt', os.O_WRONLY | os.O_CREAT)",
    "os.mkdir": "import os\nos.mkdir({dir!r} + '/new')",
    "os.link": "import os\nos.link({file!r}, 'hard')\nopen('hard', 'w').write('clobbered')",
    "os.symlink": "import os\nos.symlink({file!r}, 'soft')\nopen('soft', 'w').write('clobbered')",
    "os.chdir": "import os\nos.chdir({dir!r})\nopen('new.txt', 'w').write('escaped')",
    "os.system": "import os\nos.system('rm -rf ' + {tree!r} + ' ' + {file!r})",
    "os.popen": "import os\nos.popen('rm ' + {file!r}).read()",
    "subprocess.run": "import subprocess\nsubprocess.run(['rm', '-rf', {tree!r}])",
    "subprocess.check_output": "import subprocess\nsubprocess.check_output('rm ' + {file!r}, shell=True)",
    "os.execv": "import os\nos.execv('/bin/rm', ['rm', {file!r}])",
    "os.spawnv": "import os\nos.spawnv(os.P_WAIT, '/bin/rm', ['rm', {file!r}])",
    "os.posix_spawn": "import os\nos.waitpid(os.posix_spawn('/bin/rm', ['rm', {file!r}], {{}}), 0)",
    "os.fork": "import os\nif os.fork() == 0:\n    os._exit(0)",
    "multiprocessing": "import multiprocessing\np = multiprocessing.Process(target=print)\np.start()\np.join()",
    "os.kill": "import os, signal\nos.kill({victim}, signal.SIGKILL)",
    "os.killpg": "import os, signal\nos.killpg(os.getpgid({victim}), signal.SIGKILL)",
    "os.putenv": "import os\nos.putenv('NANOCHAT_SECRET', 'x')",
    "resource.setrlimit": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)",
    "faulthandler": "import faulthandler\nfaulthandler.enable()",
    "socket.socket": "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
    "socket.create_connection": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=0.5)",
    "ctypes": "import ctypes\nctypes.CDLL(None).unlink({file!r}.encode())",
}


@pytest.mark.quick
@pytest.mark.parametrize("call", DESTRUCTIVE_CALLS)
def test_destructive_call_fails_without_effect(call, outside):
    result = execute_code(DESTRUCTIVE_CALLS[call].format(**outside) + "\nprint('got through')", timeout=2.0)
    assert not result.success and not result.timeout
    # The guards raise PermissionError; os.getpgid meets the OS layer first, where the victim is not in the code's view.
    expected_errors = {"ctypes": ("ModuleNotFoundError",), "os.killpg": ("PermissionError", "ProcessLookupError")}
    assert result.error.startswith(expected_errors.get(call, ("PermissionError",))), result.error
    assert "got through" not in result.stdout
    # The `outside` fixture checks on teardown that every file and the victim process survived.


@pytest.mark.quick
def test_tests_call_the_candidates_function_across_processes():
    code = ("def describe(n, scale=1):\n    print('candidate')\n"
            "    return (n * scale, [n, None, 1.5, 'x'], {n: {1, 2}, 'k': frozenset()}, b'\\x00', 2j)\n"
            "def halve(n):\n    return n / 2\n")
    tests = ("assert describe(3, scale=2) == (6, [3, None, 1.5, 'x'], {3: {1, 2}, 'k': frozenset()}, b'\\x00', 2j)\n"
             "try:\n    describe('x', scale=None)\n    raise AssertionError('no error')\nexcept TypeError:\n    pass\n"
             "assert not hasattr(describe, '__globals__')  # a stub that holds a name, not the candidate's function\n"
             "assert halve(7) == 3  # the setup's helper, not the candidate's\nprint('tests')\n")
    result = execute_tests(code, tests, "describe", setup="def halve(n):\n    return n // 2\n")
    assert result.success, result
    assert result.stdout == "candidate\ncandidate\ntests\n"  # the candidate's output, then the tests'


@pytest.mark.quick
@pytest.mark.parametrize("code, error", [
    ("def total(numbers):\n    return len(numbers)\n", "AssertionError"),
    ("def total(numbers:\n", "SyntaxError: '(' was never closed"),  # the candidate's own error, not the tests'
    ("def other(numbers):\n    return sum(numbers)\n", "NameError: name 'total' is not defined"),
    ("def total(numbers):\n    return [].pop()\n", "IndexError: pop from empty list"),
    ("import os\ndef total(numbers):\n    os._exit(0)\n", "RuntimeError: the candidate's process ended before total()"),
    ("def total(numbers):\n    return total\n", "TypeError: a function cannot pass between"),
    ("class Liar(int):\n    def __eq__(self, other):\n        return True\n"
     "def total(numbers):\n    return Liar(-1)\n", "AssertionError"),  # leaves as a plain int
])
def test_tests_fail_with_the_reason(code, error):
    result = execute_tests(code, "assert total([1, 2, 3]) == 6\n", "total")
    assert not result.success and not result.timeout
    assert result.error.startswith(error), result.error


@pytest.mark.quick
def test_tests_time_out_on_a_candidate_that_never_answers():
    start = time.monotonic()
    result = execute_tests("def total(numbers):\n    while True:\n        pass\n", "total([1])\n", "total", timeout=1.0)
    assert result.timeout and not result.success and result.error.startswith("TimeoutError")
    assert result.stderr == ""  # killing the run is silent: no traceback from what supervises it
    assert time.monotonic() - start < 5.0


@pytest.mark.quick
def test_without_os_isolation_one_line_says_so():
    caller = ("from nanochat.execution import execute_code\n"
              "print(execute_code('print(1)').stdout, execute_code('print(2)').stdout, end='')")
    env = {**os.environ, "NANOCHAT_SANDBOX": "guards", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    run = subprocess.run([sys.executable, "-c", caller], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "1\n 2\n"
    assert run.stderr.count("nanochat sandbox: guards mode") == 1 and len(run.stderr.splitlines()) == 1, run.stderr


@pytest.mark.quick
def test_a_status_report_nested_200000_deep_counts_as_no_report():
    """The child's report may come from the code it ran: JSON nested too deep raised RecursionError in the parent,
    past its `except ValueError`, where any other malformed report counts as none."""
    from nanochat.execution import _parse_status

    assert _parse_status("[" * 200_000 + "]" * 200_000) is None
    assert _parse_status('{"error": null, "memory_exceeded": false}') == {"error": None, "memory_exceeded": False}
