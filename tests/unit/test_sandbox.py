"""The code tool's sandbox: what runs, what is refused (and by which layer), the limits, and the cleanup. Each run
starts a real child behind the real kernel boundary (tools/boundary.py); tests/unit/test_sandbox_escapes.py holds
an attacker's escapes. The whole file takes a few seconds."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import tracemalloc
import uuid

import pytest

from rlhfkit.config.ppo_schema import CODE_SANDBOXES
from rlhfkit.tools import SANDBOXES, code_tool, kernel_boundary_problem, resolve_tools, run_sandboxed
from rlhfkit.tools import boundary, sandbox


def refused(result, event: str) -> bool:
    """The run died of the audit hook's PermissionError for `event`."""
    return result.exit_code == 1 and f"PermissionError: sandbox: {event} refused" in result.stderr


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """A temporary folder of the test's own (other workers' runs come and go in the shared one)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_kernel_boundary_is_built_on_this_machine():
    # the machines this project runs on offer unprivileged namespaces and libseccomp: the default must work
    assert kernel_boundary_problem() is None
    result = run_sandboxed("import os\nprint(os.getpid(), os.getuid() != 0, os.getcwd())")
    assert result.confined and result.stdout == "1 True /sandbox\n", result


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


@pytest.mark.parametrize("kind", SANDBOXES)
def test_standard_library_works_and_the_folder_is_writable(kind):
    code = ("import asyncio, collections, dataclasses, datetime, decimal, fractions, itertools, json, math, random\n"
            "import re, shutil, statistics, tempfile\n"
            "import os\n"
            "with open('data.txt', 'w') as f:\n    f.write('1 2 3')\n"
            "os.mkdir('sub')\n"
            "os.rename('data.txt', 'sub/data.txt')\n"
            "print(sum(map(int, open('sub/data.txt').read().split())), sorted(os.listdir('.')))\n"
            "shutil.rmtree('sub')\n"
            "print(os.path.dirname(tempfile.mkdtemp()) == os.getcwd(), statistics.mean([1, 2, 3]))\n")
    result = run_sandboxed(code, sandbox=kind)
    assert result.stdout == "6 ['main.py', 'sub']\nTrue 2\n", result.stderr
    assert result.confined is (kind == "kernel")


def test_the_folder_and_environment_and_nothing_left_on_the_host(own_tmp):
    result = run_sandboxed("import os\nprint(os.getcwd())\nprint(os.environ['HOME'] == os.getcwd())\n"
                           "print(sorted(os.environ))\nprint(os.path.realpath('/tmp'))")
    folder, home, env, tmp = result.stdout.splitlines()
    assert (folder, home, tmp) == (boundary.SANDBOX_DIR, "True", boundary.SANDBOX_DIR)
    assert env == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR']"
    assert list(own_tmp.iterdir()) == []


@pytest.mark.parametrize("kind", SANDBOXES)
@pytest.mark.parametrize("code, kwargs", [
    ("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(60)", {"timeout_s": 0.5}),  # killed at timeout
    ("import os\nprint(os.getcwd(), flush=True)\nprint('x' * 10**6)", {}),  # killed for its output
    ("import os\nprint(os.getcwd())\nos.mkdir('locked')\nos.chmod('locked', 0)\nos.chmod('.', 0)", {}),
    ("import os\nprint(os.getcwd())\nos.remove('main.py')\nos.rmdir(os.getcwd())", {}),  # it removed its folder
])
def test_the_folder_is_removed_in_every_case(own_tmp, kind, code, kwargs):
    result = run_sandboxed(code, sandbox=kind, **kwargs)
    inside = result.stdout.split()[0]
    assert inside == boundary.SANDBOX_DIR if kind == "kernel" else inside.startswith(str(own_tmp))
    assert list(own_tmp.iterdir()) == []


def test_a_run_that_nests_a_thousand_folders_leaves_nothing(own_tmp):
    # the kernel alone (the hook's path checks walk every level: quadratic in the depth)
    result = run_sandboxed("import os\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\n"
                           "print(len(os.getcwd()))", audit_hook=False)
    assert result.stdout == f"{len('/sandbox') + 2 * 1200}\n", result.stderr
    assert list(own_tmp.iterdir()) == []


def test_a_thousand_nested_folders_are_removed_without_recursion(tmp_path):
    top = tmp_path / "run"
    os.makedirs(top)
    fd = os.open(top, os.O_RDONLY)
    for _ in range(1500):  # deeper than PATH_MAX allows as one path, and than the recursion limit
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    sandbox.remove_folder(str(top))
    assert not top.exists()


def test_the_folder_is_removed_when_the_parent_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(boundary, "interpreter", lambda: str(tmp_path / "no-such-python"))
    with pytest.raises(FileNotFoundError):
        run_sandboxed("print(1)", sandbox="hook")
    assert list(tmp_path.iterdir()) == []


def test_reading_outside_is_refused_reading_the_standard_library_is_not():
    assert refused(run_sandboxed("open('/etc/passwd').read()"), "open")
    assert refused(run_sandboxed("import os\nos.listdir('/')"), "os.listdir")
    assert refused(run_sandboxed("import os\nos.open(os.path.dirname(os.__file__), os.O_RDONLY)"), "open")
    ok = run_sandboxed("import os\nprint(len(open(os.__file__).read()) > 1000)")
    assert ok.stdout == "True\n", ok.stderr
    # the kernel alone: the host's files are not there at all
    alone = run_sandboxed("open('/etc/passwd').read()", audit_hook=False)
    assert alone.exit_code == 1 and "FileNotFoundError" in alone.stderr


def test_patching_modules_does_not_blind_the_hook():
    code = ("import builtins, os, posixpath\n"
            "posixpath.realpath = os.path.realpath = lambda p, **k: os.getcwd() + '/x'\n"
            "os.getcwd = lambda: '/'\n"
            "builtins.isinstance = lambda *a: True\n"
            "builtins.str = builtins.len = lambda *a: 0\n"
            "open('/etc/passwd').read()")
    assert refused(run_sandboxed(code, sandbox="hook"), "open")


@pytest.mark.parametrize("hook", [True, False])
def test_writing_outside_is_refused(hook):
    name = f"escape-{uuid.uuid4().hex}"
    result = run_sandboxed(f"open('/{name}', 'w').write('escaped')", audit_hook=hook)
    assert result.exit_code == 1 and not os.path.exists(f"/{name}")
    assert ("writing outside the sandbox folder" if hook else "Read-only file system") in result.stderr
    # inside, /tmp is the sandbox's own tmpfs: the host's /tmp never sees the file
    result = run_sandboxed(f"open('/tmp/{name}', 'w').write('escaped')\nprint(open('/tmp/{name}').read())",
                           audit_hook=hook)
    assert result.stdout == "escaped\n" and not os.path.exists(f"/tmp/{name}")
    result = run_sandboxed("import os\nopen(os.__file__, 'a').write('#')", audit_hook=hook)
    assert result.exit_code == 1 and "PermissionError" in result.stderr
    # everything but the sandbox's folder is mounted read-only (and owned by others)
    result = run_sandboxed("import os\nprint([bool(os.statvfs(p).f_flag & os.ST_RDONLY) for p in "
                           "('/', os.__file__, '/usr/lib', '/dev/null', '/sandbox', '/tmp')])", audit_hook=False)
    assert result.stdout == "[True, True, True, True, False, False]\n", result.stderr


def test_hook_refusals_of_links_and_dotdot():
    target = f"/tmp/escape-{uuid.uuid4().hex}"
    assert refused(run_sandboxed("open('../escape.txt', 'w')", sandbox="hook"), "open")  # '..' in any path
    assert refused(run_sandboxed("import os\nos.symlink('/etc', 'etc')", sandbox="hook"), "os.symlink")
    assert refused(run_sandboxed("import os\nos.remove(os.__file__)", sandbox="hook"), "os.remove")
    assert refused(run_sandboxed(f"import os\nos.rename('main.py', {target!r})", sandbox="hook"), "os.rename")
    assert not os.path.exists(target)


@pytest.mark.parametrize("hook", [True, False])
def test_no_network(hook):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result = run_sandboxed(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
                               audit_hook=hook)
        if hook:
            assert refused(result, "socket.__new__") or refused(result, "socket.getaddrinfo"), result.stderr
        else:  # the seccomp filter refuses every socket family but AF_UNIX
            assert result.exit_code == 1 and "PermissionError: [Errno 1]" in result.stderr, result.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever connected
            server.accept()


def test_unix_socket_pairs_work_so_asyncio_does():
    result = run_sandboxed("import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 3\n"
                           "print(asyncio.run(f()))", audit_hook=False)
    assert result.stdout == "3\n", result.stderr


@pytest.mark.parametrize("code, event", [
    ("import os\nwhile True:\n    os.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['echo', 'escaped'])", "subprocess.Popen"),
    ("import os\nos.system('echo escaped')", "os.system"),
    ("import os\nos.execv('/bin/echo', ['echo', 'escaped'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/echo', ['echo', 'escaped'], {})", "os.posix_spawn"),
    ("import ctypes\nctypes.CDLL(None)", "import"),
    ("import os\nos.kill(os.getpid() + 1, 0)", "os.kill"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit"),
    ("import sqlite3", "import"),  # opens files from C, without audit events
    ("import gc\ngc.get_objects()", "gc.get_objects"),
    ("import sys\nsys.settrace(lambda *a: None)", "sys.settrace"),
])
def test_processes_ctypes_and_escape_hatches_are_refused_by_the_hook(code, event):
    result = run_sandboxed(code)
    assert refused(result, event), result.stderr
    assert "escaped" not in result.stdout


@pytest.mark.parametrize("code", [
    "import os\nprint(os.fork())",
    "import os\nos.execv('/bin/echo', ['echo', 'escaped'])",
    "import os\nos.posix_spawn('/bin/echo', ['echo', 'escaped'], {})",
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "assert libc.syscall(56, 0x11, 0, 0, 0, 0) == -1, 'clone'\n"  # clone(SIGCHLD): a new process
    "raise PermissionError(ctypes.get_errno())",
])
def test_the_kernel_refuses_new_processes_by_itself(code):
    result = run_sandboxed(code, audit_hook=False)
    assert result.exit_code == 1 and "PermissionError" in result.stderr, result.stderr
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


@pytest.mark.parametrize("kind", SANDBOXES)
def test_file_size_limit(kind):
    code = ("import os\ntry:\n    open('big', 'wb').write(b'0' * (100 << 20))\n"
            "except OSError as exc:\n    print(exc.strerror, os.path.getsize('big'))")
    result = run_sandboxed(code, files_mb=16, sandbox=kind)
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


def test_without_namespaces_the_tool_refuses_unless_the_user_opts_out(monkeypatch):
    # a kernel without unprivileged namespaces (as this one would answer): one line, the opt-out named as typed
    monkeypatch.setattr(sandbox, "kernel_boundary_problem", lambda: "unshare: [Errno 1] Operation not permitted")
    with pytest.raises(OSError, match="cannot build: unshare.*Set episode.code_sandbox=hook to run it"):
        resolve_tools(["calculator", "python"])
    [tool] = resolve_tools(["python"], code_sandbox="hook")
    assert tool({"code": "print(6 * 7)"}) == "42"
    assert CODE_SANDBOXES == SANDBOXES  # the config's choices are the sandbox's


def test_a_set_up_that_fails_is_reported_and_runs_nothing(monkeypatch):
    plan = boundary.view()
    broken = boundary.View(plan.python, plan.steps + (("bind", "/no/such/folder"),), plan.pivot_root)
    monkeypatch.setattr(boundary, "view", lambda: broken)
    result = run_sandboxed("print('ran')")
    assert result.stdout == "" and result.exit_code == sandbox.SETUP_FAILED and not result.confined
    assert result.killed_reason.startswith("sandbox set-up failed: ") and "/no/such/folder" in result.killed_reason
    assert "error: killed (sandbox set-up failed" in sandbox.tool_output(result, 5, 100)


def test_the_view_holds_the_interpreter_and_hides_every_package_folder():
    plan = boundary.view()
    binds = {step[1] for step in plan.steps if step[0] == "bind"}
    hidden = {step[1] for step in plan.steps if step[0] == "hide"}
    assert plan.python == os.path.realpath(sys._base_executable) and any(
        plan.python.startswith(b + "/") or plan.python == b for b in binds)
    assert not any(b.startswith(sys.prefix) for b in binds) or sys.prefix == sys.base_prefix  # no venv
    site = os.path.join(os.path.dirname(os.__file__), "site-packages")
    assert os.path.realpath(site) in hidden


def test_concurrent_calls_from_threads_each_see_only_their_own_folder():
    # as episode.workers run tool calls: one namespace and tmpfs per call
    from concurrent.futures import ThreadPoolExecutor

    code = ("import os, time\nopen('mine', 'w').write('{n}')\ntime.sleep(0.2)\n"
            "print(sorted(os.listdir('.')), open('mine').read())")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: run_sandboxed(code.format(n=n)), range(8)))
    assert [r.stdout for r in results] == [f"['main.py', 'mine'] {n}\n" for n in range(8)]
