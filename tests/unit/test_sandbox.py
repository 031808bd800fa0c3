"""The code tool's sandbox: what runs, what is refused (and by which layer), the limits, and the cleanup. Each run
starts a real child Python; the whole file takes a few seconds."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import tracemalloc
import uuid

import pytest

from rlhfkit.tools import code_tool, network_isolation_available, run_sandboxed


def refused(result, event: str) -> bool:
    """The run died of the audit hook's PermissionError for `event`."""
    return result.exit_code == 1 and f"PermissionError: sandbox: {event} refused" in result.stderr


def test_prints_come_back_and_exit_codes_propagate():
    result = run_sandboxed("import sys\nprint('hello', 6 * 7)\nprint('to stderr', file=sys.stderr)")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello 42\n", "to stderr\n", 0)
    assert not (result.timed_out or result.truncated or result.killed_reason)
    assert run_sandboxed("raise SystemExit(3)").exit_code == 3
    assert run_sandboxed("import os\nos._exit(7)").exit_code == 7
    crashed = run_sandboxed("def f():\n    return 1 / 0\n\nf()")
    assert crashed.exit_code == 1
    # the traceback shows the code's own frames, not the prelude's
    assert crashed.stderr.startswith("Traceback") and 'File "main.py", line 2, in f' in crashed.stderr
    assert "prelude" not in crashed.stderr and crashed.stderr.endswith("ZeroDivisionError: division by zero\n")


def test_standard_library_works_and_the_folder_is_writable():
    code = ("import asyncio, collections, dataclasses, datetime, decimal, fractions, itertools, json, math, random\n"
            "import re, shutil, statistics, tempfile\n"
            "import os\n"
            "with open('data.txt', 'w') as f:\n    f.write('1 2 3')\n"
            "os.mkdir('sub')\n"
            "os.rename('data.txt', 'sub/data.txt')\n"
            "print(sum(map(int, open('sub/data.txt').read().split())), sorted(os.listdir('.')))\n"
            "shutil.rmtree('sub')\n"
            "print(os.path.dirname(tempfile.mkdtemp()) == os.getcwd(), statistics.mean([1, 2, 3]))\n")
    result = run_sandboxed(code)
    assert result.stdout == "6 ['main.py', 'sub']\nTrue 2\n", result.stderr


def test_the_folder_exists_while_it_runs_and_is_gone_after():
    result = run_sandboxed("import os\nprint(os.getcwd())\nprint(os.environ['HOME'] == os.getcwd())\n"
                           "print(sorted(os.environ))")
    folder, home, env = result.stdout.splitlines()
    assert os.path.basename(folder).startswith("rlhfkit-sandbox-") and home == "True"
    assert env == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR']"
    assert not os.path.exists(folder)


@pytest.mark.parametrize("code, kwargs", [
    ("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(60)", {"timeout_s": 0.5}),  # killed at timeout
    ("import os\nprint(os.getcwd(), flush=True)\nprint('x' * 10**6)", {}),  # killed for its output
    ("import os\nprint(os.getcwd())\nos.mkdir('locked')\nos.chmod('locked', 0)\nos.chmod('.', 0)", {}),
    ("import os\nprint(os.getcwd())\nos.remove('main.py')\nos.rmdir(os.getcwd())", {}),  # it removed its folder
])
def test_the_folder_is_removed_in_every_case(code, kwargs):
    result = run_sandboxed(code, **kwargs)
    folder = result.stdout.split()[0]
    assert folder.startswith(tempfile.gettempdir()) and not os.path.exists(folder)


def test_the_folder_is_removed_when_the_parent_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(FileNotFoundError):
        run_sandboxed("print(1)")
    assert list(tmp_path.iterdir()) == []


def test_reading_outside_is_refused_reading_python_is_not():
    assert refused(run_sandboxed("open('/etc/passwd').read()"), "open")
    assert refused(run_sandboxed("import os\nos.listdir('/')"), "os.listdir")
    assert refused(run_sandboxed("import os\nos.open(os.path.dirname(os.__file__), os.O_RDONLY)"), "open")
    ok = run_sandboxed("import os\nprint(len(open(os.__file__).read()) > 1000)")
    assert ok.stdout == "True\n", ok.stderr


def test_patching_modules_does_not_blind_the_hook():
    code = ("import builtins, os, posixpath\n"
            "posixpath.realpath = os.path.realpath = lambda p, **k: os.getcwd() + '/x'\n"
            "os.getcwd = lambda: '/'\n"
            "builtins.isinstance = lambda *a: True\n"
            "builtins.str = builtins.len = lambda *a: 0\n"
            "open('/etc/passwd').read()")
    assert refused(run_sandboxed(code), "open")


def test_writing_outside_is_refused():
    target = f"/tmp/escape-{uuid.uuid4().hex}"
    result = run_sandboxed(f"open({target!r}, 'w').write('escaped')")
    assert refused(result, "open") and "writing outside the sandbox folder" in result.stderr
    assert not os.path.exists(target)
    assert refused(run_sandboxed(f"import os\nos.mkdir({target!r})"), "os.mkdir")
    assert refused(run_sandboxed("open('../escape.txt', 'w')"), "open")  # '..' is refused in any path
    assert refused(run_sandboxed("import os\nos.symlink('/etc', 'etc')"), "os.symlink")
    assert refused(run_sandboxed("import os\nos.remove(os.__file__)"), "os.remove")
    assert refused(run_sandboxed(f"import os\nos.rename('main.py', {target!r})"), "os.rename")
    assert not os.path.exists(target)


def test_socket_connect_is_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result = run_sandboxed(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert refused(result, "socket.__new__") or refused(result, "socket.getaddrinfo"), result.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever connected
            server.accept()


def test_network_namespace_is_reported():
    available = network_isolation_available()
    assert isinstance(available, bool)
    assert run_sandboxed("pass").network_isolated is available


@pytest.mark.parametrize("code, event", [
    ("import os\nwhile True:\n    os.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['echo', 'escaped'])", "subprocess.Popen"),
    ("import os\nos.system('echo escaped')", "os.system"),
    ("import os\nos.execv('/bin/echo', ['echo', 'escaped'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/echo', ['echo', 'escaped'], {})", "os.posix_spawn"),
    ("import ctypes\nctypes.CDLL(None)", "ctypes.dlopen"),
    ("import os\nos.kill(os.getppid(), 0)", "os.kill"),  # the trainer is the same user
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit"),
    ("import sqlite3", "import"),  # opens files from C, without audit events
    ("import gc\ngc.get_objects()", "gc.get_objects"),
])
def test_processes_ctypes_and_escape_hatches_are_refused(code, event):
    result = run_sandboxed(code)
    assert refused(result, event), result.stderr
    assert "escaped" not in result.stdout


def test_process_functions_without_audit_events_are_gone():
    result = run_sandboxed("import _posixsubprocess, os, signal\n"
                           "print(hasattr(os, 'pidfd_open'), hasattr(signal, 'pidfd_send_signal'), "
                           "hasattr(os, 'mkfifo'))\n"
                           "_posixsubprocess.fork_exec(['/bin/echo'], [b'/bin/echo'], True, (), None, None, "
                           "-1, -1, -1, -1, -1, -1, -1, -1, False, False, -1, None, None, None, -1, None)")
    assert result.stdout == "False False False\n"
    assert "PermissionError: sandbox: starting processes is refused" in result.stderr


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run_sandboxed("while True:\n    pass", timeout_s=1)
    assert time.monotonic() - start < 3
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code < 0


def test_memory_limit():
    result = run_sandboxed("b = bytearray(1 << 30)", memory_mb=128)
    assert result.exit_code == 1 and result.stderr.endswith("MemoryError\n")
    assert run_sandboxed("print(len(bytearray(32 << 20)))", memory_mb=128).stdout == f"{32 << 20}\n"


def test_output_is_capped_and_the_parent_stays_small():
    tracemalloc.start()
    try:
        result = run_sandboxed("print('x' * 10**7)", output_bytes=8192)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.stdout == "x" * 8192 and result.truncated
    assert result.killed_reason == "output flood"  # 10 MB is far past 4x the cap: killed, not read to the end
    assert peak < 1 << 20  # the parent never held the 10 MB
    # a little past the cap: truncated, read to the end, not killed
    small = run_sandboxed("import sys\nprint('y' * 10000)\nprint('z' * 10000 + '!', file=sys.stderr)",
                          output_bytes=8192)
    # stdout's start, stderr's end (where a traceback says what went wrong)
    assert (small.stdout, small.stderr, small.exit_code) == ("y" * 8192, "z" * 8190 + "!\n", 0)
    assert small.truncated and small.killed_reason is None


def test_file_size_limit():
    code = ("import os\ntry:\n    open('big', 'wb').write(b'0' * (100 << 20))\n"
            "except OSError as exc:\n    print(exc.strerror, os.path.getsize('big'))")
    result = run_sandboxed(code, files_mb=16)
    assert result.stdout == f"File too large {16 << 20}\n", result.stderr


def test_code_tool():
    tool = code_tool(timeout_s=1, output_bytes=100)
    assert tool.name == "python" and tool.parameters["required"] == ["code"]
    assert tool({"code": "print(6 * 7)"}) == "42"
    assert tool({"code": "pass"}) == "(no output)"
    failed = tool({"code": "print('before')\nprint('noise ' * 30, file=__import__('sys').stderr)\n1 / 0"})
    assert failed.startswith("before\nstderr:\n") and "ZeroDivisionError: division by zero\n" in failed
    assert failed.endswith("error: exit code 1\nerror: output truncated to 100 bytes")
    assert tool({"code": "while True:\n    pass"}) == "error: timed out after 1s"
    assert tool({"code": "print('a' * 150)"}) == "a" * 100 + "\nerror: output truncated to 100 bytes"
    assert tool({}) == "error: missing required argument 'code'"
