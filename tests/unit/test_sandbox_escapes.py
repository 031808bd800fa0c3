"""An attacker's escapes from the code tool (issue 63), each through the real sandbox: the four that beat the old
audit-hook-only sandbox, and its resource holes. Each runs behind the kernel boundary with the audit hook (the
default) and without it (the kernel alone must hold), and where it says so with the hook alone (sandbox="hook",
the documented opt-out). Contained means: refused, or ran against nothing of the host's, with nothing left running
and the trainer unharmed."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sysconfig
import uuid

import pytest

from rlhfkit.tools import run_sandboxed

LIB_DYNLOAD = sysconfig.get_config_var("DESTSHARED")  # where the standard library's extension modules are
BASE_SITE = os.path.join(os.path.dirname(os.__file__), "site-packages")
LAYERS = [pytest.param({"audit_hook": True}, id="kernel+hook"), pytest.param({"audit_hook": False}, id="kernel"),
          pytest.param({"sandbox": "hook"}, id="hook-only")]
KERNEL_LAYERS = LAYERS[:2]


def extension(name: str) -> str:
    found = glob.glob(os.path.join(LIB_DYNLOAD, name + ".*so"))
    if not found:
        pytest.skip(f"this Python has no {name} extension to load under another name")
    return found[0]


# 1. A signal handler that reaches the hook's path resolver and edits its lists, so that any path resolves inside
# the folder. The hook now runs its path checks with every signal blocked; behind the kernel boundary the host's
# files are not there at all. Against the old sandbox this printed "82 47 37" (reads, writes, listings of 1000).
RACE = """
import os, signal
def handler(signum, frame):
    while frame is not None:
        if frame.f_code.co_name in ('_resolve', '_path_refusal'):
            for value in frame.f_locals.values():
                if isinstance(value, list):
                    value[:] = [p for p in os.getcwd().split('/') if p]
        frame = frame.f_back
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)
read = written = listed = 0
for _ in range(1000):
    try:
        read += 'root:' in open('/etc/passwd').read()
    except OSError:
        pass
    try:
        open('/escape-TOKEN', 'w').write('x'); written += 1
    except OSError:
        pass
    try:
        listed += 'key' in os.listdir('SECRET')
    except OSError:
        pass
signal.setitimer(signal.ITIMER_REAL, 0)
print(read, written, listed)
"""


@pytest.mark.parametrize("layers", LAYERS)
def test_a_signal_handler_racing_the_hook_gets_nothing(layers):
    token = uuid.uuid4().hex
    secret = f"/var/tmp/rlhfkit-secret-{token}"  # a folder of the host's (the sandbox's /tmp is its own)
    os.makedirs(secret)
    open(os.path.join(secret, "key"), "w").close()
    try:
        result = run_sandboxed(RACE.replace("TOKEN", token).replace("SECRET", secret), timeout_s=30, **layers)
    finally:
        os.remove(os.path.join(secret, "key"))
        os.rmdir(secret)
    assert result.stdout == "0 0 0\n", result.stderr
    assert not os.path.exists(f"/escape-{token}")


# 2. Refused modules loaded under another name (importlib with a file location): readline reads and writes any
# file, _posixsubprocess starts processes (with setsid: one that outlives the run), spwd reads /etc/shadow,
# _posixshmem makes shared memory.
def load_as(name: str, path: str) -> str:
    return ("import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('x.{name}', {path!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n")


ALIASED = {
    "readline": "print(module.read_history_file('/etc/passwd'))\nmodule.write_history_file('/escape-TOKEN')\n",
    "_posixsubprocess": ("import subprocess\nsubprocess._fork_exec = module.fork_exec\n"
                         "subprocess.Popen(['/bin/sh', '-c', 'sleep 3; echo escaped > /escape-TOKEN'], "
                         "start_new_session=True)\nprint('started')\n"),
    "spwd": "print(module.getspnam('root'))\n",
    "_posixshmem": "import os\nprint(module.shm_open('/rlhfkit-TOKEN', os.O_CREAT | os.O_RDWR, 0o600))\n",
}


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("name", sorted(ALIASED))
def test_a_refused_module_under_another_name_is_contained(name, layers):
    token = uuid.uuid4().hex
    code = load_as(name, extension(name)) + ALIASED[name].replace("TOKEN", token)
    result = run_sandboxed(code, **layers)
    if layers.get("audit_hook", True):  # the hook refuses it by its file's name
        assert "PermissionError: sandbox: import refused: importing this module is not allowed" in result.stderr
    else:  # the kernel: the module loads, and what it tries fails
        assert result.exit_code == 1 and ("Error" in result.stderr.splitlines()[-1]), result.stderr
    assert result.stdout == "" and "root:" not in result.stderr
    assert not os.path.exists(f"/escape-{token}") and not os.path.exists(f"/dev/shm/rlhfkit-{token}")


# 3. Functions the prelude deleted, brought back by a second copy of their module (re-importing posix, or
# _imp.create_builtin): pidfd_open then pidfd_send_signal reached the trainer; mknod made special files.
RESTORED = {
    "reimport": "import sys\ndel sys.modules['posix']\nimport posix\n",
    "create_builtin": ("import _imp, importlib.machinery\nposix = _imp.create_builtin(importlib.machinery.ModuleSpec("
                       "'posix', importlib.machinery.BuiltinImporter))\n"),
}


@pytest.mark.parametrize("layers", KERNEL_LAYERS)
@pytest.mark.parametrize("how", sorted(RESTORED))
@pytest.mark.parametrize("call", ["posix.pidfd_open(os.getpid())", "posix.mknod('fifo', 0o10600)",
                                  "posix.pidfd_open(1)"])
def test_restored_functions_are_refused_by_the_kernel(how, call, layers):
    result = run_sandboxed("import os\n" + RESTORED[how] + f"print({call})", **layers)
    assert result.exit_code == 1 and result.stdout == "", result.stderr
    assert "PermissionError" in result.stderr.splitlines()[-1] or "ImportError" in result.stderr


# 4. A package of the base interpreter's own site-packages (cffi: dlopen(None).system(...)).
CFFI = (f"import sys\nsys.path.append({BASE_SITE!r})\nimport cffi\nffi = cffi.FFI()\n"
        "ffi.cdef('int system(const char *);')\nprint(ffi.dlopen(None).system(b'echo escaped > /escape-TOKEN'))\n")


@pytest.mark.parametrize("layers", LAYERS)
def test_third_party_packages_are_out_of_reach(layers):
    if not os.path.isdir(os.path.join(BASE_SITE, "cffi")):
        pytest.skip("the base interpreter has no cffi to reach for")
    token = uuid.uuid4().hex
    result = run_sandboxed(CFFI.replace("TOKEN", token), **layers)
    assert result.exit_code == 1 and result.stdout == "" and not os.path.exists(f"/escape-{token}")
    if "sandbox" in layers:  # the hook: package folders are not the standard library, so the finder sees none
        assert "ModuleNotFoundError: No module named 'cffi'" in result.stderr
    else:  # the kernel: an empty folder covers every site-packages
        assert "ModuleNotFoundError: No module named 'cffi'" in result.stderr
        listed = run_sandboxed(f"import os\nprint(os.listdir({BASE_SITE!r}))", audit_hook=False)
        assert listed.stdout == "[]\n", listed.stderr


# Resources the old limits missed.
@pytest.mark.parametrize("layers", KERNEL_LAYERS)
def test_memory_outside_the_address_space_limit_is_refused(layers):
    code = ("import os\nfd = os.memfd_create('big')\n"
            "for _ in range(90):\n    os.write(fd, b'0' * (1 << 20))\nprint(os.fstat(fd).st_size)")
    result = run_sandboxed(code, memory_mb=64, **layers)
    assert result.exit_code == 1 and result.stdout == "" and "PermissionError" in result.stderr


@pytest.mark.parametrize("layers", KERNEL_LAYERS)
def test_total_disk_is_bounded_not_only_each_file(layers):
    code = ("written = 0\ntry:\n    for i in range(30):\n        open(f'f{i}', 'wb').write(b'0' * (1 << 20))\n"
            "        written += 1\nexcept OSError as exc:\n    print(written, exc.strerror)")
    result = run_sandboxed(code, files_mb=1, **layers)
    assert result.stdout in ("0 No space left on device\n", "1 No space left on device\n"), result.stderr


def test_nothing_the_code_starts_outlives_the_call():
    # it names itself, tries every way to leave a process behind, and starts a thread that would run on
    marker = "rlhf" + uuid.uuid4().hex[:10]
    code = (f"open('/proc/self/comm', 'w').write({marker!r})\n"
            "import os, threading, time, subprocess\n"
            + load_as("_posixsubprocess", extension("_posixsubprocess")) +
            "subprocess._fork_exec = module.fork_exec\n"
            "for start in (lambda: os.fork(), lambda: subprocess.Popen(['/bin/sleep', '30'], "
            "start_new_session=True)):\n"
            "    try:\n        start()\n    except OSError as exc:\n        print(type(exc).__name__)\n"
            "threading.Thread(target=time.sleep, args=(30,)).start()\nprint('thread', flush=True)\n")
    result = run_sandboxed(code, timeout_s=1, audit_hook=False)
    assert result.stdout == "PermissionError\nPermissionError\nthread\n" and result.timed_out, result.stderr
    names = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            names.append(open(f"/proc/{pid}/comm").read().strip())
        except OSError:
            pass
    assert marker[:15] not in names


@pytest.mark.parametrize("code", [
    "import os, signal\nos.kill(-1, signal.SIGKILL)",  # every process it may signal
    "import os, signal\nos.kill(0, signal.SIGKILL)",  # its process group
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "import os\nos.pidfd_open(1)",
])
def test_the_trainer_and_its_other_processes_are_unharmed(code):
    canary = subprocess.Popen(["sleep", "30"], start_new_session=False)
    try:
        result = run_sandboxed(code, audit_hook=False)
        assert canary.poll() is None  # the test process runs this line: it is alive, and so is its child
    finally:
        canary.kill()
        canary.wait()
    # it reached nothing but itself: no such process (1), or its own group, where as its namespace's PID 1 it
    # ignores the signal (0) or dies of it (-9)
    assert result.exit_code in (0, 1, -signal.SIGKILL), result
