"""The code tool: model-written Python run in a separate, limited process. Off unless a user lists "python".

`run_sandboxed` starts `python -I -S -B -X utf8` (isolated mode, standard library only, no bytecode written) in
a fresh temporary folder, its cwd and HOME, removed afterwards whatever happens, in a new session with an
environment of PATH, LANG, HOME, TMPDIR and PYTHONDONTWRITEBYTECODE only. A prelude (`PRELUDE`) runs in the
child before the code and sets up, in this order:

1. no network, where the kernel allows it: a new user namespace holding a new, empty network namespace
   (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`, by ctypes before Python 3.12). `network_isolation_available()`
   says whether it works here, and each result's `network_isolated` whether it held for that run;
2. kernel limits: address space (memory_mb), file size (files_mb), CPU seconds (the timeout + 1), 64 open
   files, 16 processes or threads (fork bombs), no core dumps;
3. `_posixsubprocess.fork_exec`, and os/signal functions that raise no audit event and act on other processes
   or make special files (pidfd_open, pidfd_send_signal, setpriority, sched_set*, mkfifo, mknod, chroot), removed;
4. an audit hook (`sys.addaudithook`; it cannot be removed) raising PermissionError("sandbox: ...") for:
   writing, creating, renaming, removing or chmod-ing outside the folder; reading outside the folder and
   Python's installation (sys.prefix, sys.base_prefix, the standard library); paths with '..'; opening a
   directory outside the folder (a dir_fd there would escape the checks); symlinks and hard links; sockets;
   subprocesses, fork, exec, spawn, os.system; signals to other processes (the trainer is the same user);
   ctypes; changing rlimits; subinterpreters; gc's object graph; swapping the code of its own functions; importing
   modules whose C code opens files or processes without audit events (sqlite3, dbm, readline,
   multiprocessing, shared memory, tkinter, _test*) and native extensions from outside Python's installation.
   The hook reads paths with C functions bound at its definition, so patching os.path or builtins does not
   blind it.

The parent reads stdout and stderr concurrently, keeps output_bytes of each (stdout's start, stderr's end; the
rest is counted and dropped: `truncated`), kills the whole process group when the wall-clock timeout passes or a
stream runs past 4x the cap, and never holds more than that in memory.

What it does NOT protect against: it is not a container. Kernel exploits; memory corruption of the interpreter
(crafted bytecode via marshal or code objects, known CPython crashers) which then runs native code the hook
never sees (the namespaces, rlimits and session still hold); C code in allowed modules that touches files without
an audit event; reading which files exist (os.stat raises no event); CPU and memory use up to the limits. Run
the trainer itself as an unprivileged user: as root, files root owns outside the folder are guarded by the hook
alone. What it costs the code: third-party packages, subprocesses, and asyncio's event loop (it opens a
socketpair) are unavailable.
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rlhfkit.tools.function import Tool

FLOOD_FACTOR = 4  # a stream this many times past its cap gets the process killed
MAX_PROCESSES = 16
MAX_OPEN_FILES = 64
CODE_FILE = "main.py"


@dataclass
class SandboxResult:
    """What a sandboxed run printed and how it ended.

    stdout, stderr: the first output_bytes of stdout and the last of stderr (where a traceback's error is),
    decoded as UTF-8 (undecodable bytes replaced);
    exit_code: the process's exit status, or minus the signal that killed it (as subprocess reports it);
    timed_out: it ran past the wall-clock timeout or its CPU-time limit and was killed;
    truncated: a stream had more than output_bytes (the rest was dropped);
    killed_reason: why it was killed ("timeout", "output flood", "cpu time", or "signal SIGxxx"), None if it
    exited by itself; network_isolated: it ran in its own empty network namespace (the audit hook refuses
    sockets either way).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool
    killed_reason: str | None
    network_isolated: bool = False


# Runs in the child (see BOOTSTRAP), with the arguments folder, status_fd, memory_bytes, file_bytes, cpu_s,
# open_files, processes, before the code in folder/main.py. Everything the audit hook and its helpers use is bound
# as a default argument (a tuple: immutable), so code which patches modules or builtins cannot change what the hook
# checks.
PRELUDE = r'''
import os, sys, resource

def _no_network():
    """unshare(CLONE_NEWUSER | CLONE_NEWNET): a user namespace (no privilege needed) with an empty network one."""
    flags = 0x10000000 | 0x40000000
    try:
        if hasattr(os, "unshare"):
            os.unshare(flags)
        else:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(flags) != 0:
                return 0
        return 1
    except Exception:
        return 0

def _set_limits(memory, files, cpu, open_files, processes):
    for which, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_FSIZE, files, files),
                              (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL after
                              (resource.RLIMIT_NOFILE, open_files, open_files),
                              (resource.RLIMIT_NPROC, processes, processes), (resource.RLIMIT_CORE, 0, 0)):
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:  # a limit can only be lowered
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))

def _remove_unaudited():
    import _posixsubprocess, _signal
    def fork_exec(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is refused")
    _posixsubprocess.fork_exec = fork_exec
    names = ("pidfd_open", "setpriority", "sched_setaffinity", "sched_setscheduler", "sched_setparam",
             "mkfifo", "mknod", "chroot", "setns", "unshare")
    for module, gone in ((os, names), (sys.modules["posix"], names), (_signal, ("pidfd_send_signal",))):
        for name in gone:
            if hasattr(module, name):
                delattr(module, name)

def _text(p, _type=type, _str=str, _bytes=bytes, _enc=str.encode, _dec=bytes.decode, _sub=issubclass):
    """A path argument as an exact str (subclasses and bytes converted by the base methods); None otherwise."""
    t = _type(p)
    if t is _str:
        return p
    if _sub(t, _str):
        return _dec(_enc(p, "utf-8", "surrogateescape"), "utf-8", "surrogateescape")
    if _sub(t, _bytes):
        return _dec(p, "utf-8", "surrogateescape")
    return None

def _resolve(path, base, _getcwd=os.getcwd, _lstat=os.lstat, _readlink=os.readlink, _OSError=OSError,
             _PermissionError=PermissionError):
    """The absolute path `path` (relative to `base`, or the cwd when base is None) names, symlinks followed."""
    if not path.startswith("/"):
        path = (_getcwd() if base is None else base) + "/" + path
    todo = path.split("/")
    todo.reverse()
    parts, hops = [], 0
    while todo:
        part = todo.pop()
        if part == "" or part == ".":
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        here = "/".join([""] + parts + [part])
        try:
            mode = _lstat(here).st_mode
        except _OSError:  # not there (yet): the rest is read as written
            parts.append(part)
            continue
        if mode & 0o170000 == 0o120000:
            hops += 1
            if hops > 40:
                raise _PermissionError("sandbox: too many symbolic links")
            if _readlink(here).startswith("/"):
                parts = []
            more = _readlink(here).split("/")
            more.reverse()
            todo.extend(more)
        else:
            parts.append(part)
    return "/" + "/".join(parts)

def _fd_dir(fd, _str=str, _readlink=os.readlink, _OSError=OSError):
    """The path an open file descriptor refers to (the kernel's own record), or None."""
    try:
        return _readlink("/proc/self/fd/" + _str(fd))
    except _OSError:
        return None

def _within(path, root):
    return path == root or path.startswith(root + "/")

def _path_refusal(path, dir_fd, write, is_open, folder, roots, devices, _type=type, _int=int, _text=_text,
                  _resolve=_resolve, _fd_dir=_fd_dir, _within=_within, _stat=os.stat, _OSError=OSError):
    """Why this path may not be used (a short text), or None when it may."""
    base = None
    if _type(path) is _int or _type(dir_fd) is _int and dir_fd not in (-1, -100):
        base = _fd_dir(path if _type(path) is _int else dir_fd)
        if base is None:
            return "a file descriptor it cannot place"
        if _type(path) is _int:
            if not write or _within(base, folder):
                return None
            return "changing a file outside the sandbox folder"
    text = _text(path)
    if text is None:
        return "a path that is not a string"
    if ".." in text.split("/"):
        return "'..' in a path"
    real = _resolve(text, base)
    if real in devices or _within(real, folder):
        return None
    if write:
        return "writing outside the sandbox folder"
    for root in roots:
        if _within(real, root):
            try:
                directory = _stat(real).st_mode & 0o170000 == 0o040000
            except _OSError:
                directory = False
            return "opening a directory outside the sandbox folder" if is_open and directory else None
    return "reading outside the sandbox folder and Python's installation"

# event: (whether it changes the file system, (path argument, its dir_fd argument or None), ...)
_PATH_EVENTS = (
    ("os.remove", True, ((0, 1),)), ("os.rmdir", True, ((0, 1),)), ("os.mkdir", True, ((0, 2),)),
    ("os.rename", True, ((0, 2), (1, 3))), ("os.chmod", True, ((0, 2),)), ("os.chown", True, ((0, 3),)),
    ("os.chflags", True, ((0, None),)), ("os.utime", True, ((0, 3),)), ("os.truncate", True, ((0, None),)),
    ("os.setxattr", True, ((0, None),)), ("os.removexattr", True, ((0, None),)), ("os.chdir", True, ((0, None),)),
    ("os.getxattr", False, ((0, None),)), ("os.listxattr", False, ((0, None),)),
    ("os.listdir", False, ((0, None),)), ("os.scandir", False, ((0, None),)),
)
_REFUSED_EVENTS = frozenset((
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "os.startfile", "os.unshare", "os.setns", "os.link", "os.symlink", "resource.setrlimit", "resource.prlimit",
    "cpython.PyInterpreterState_New", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sqlite3.connect", "sqlite3.load_extension", "sqlite3.enable_load_extension", "sys.remote_exec"))
_REFUSED_PREFIXES = ("socket.", "ctypes.", "syslog.", "webbrowser.", "winreg.", "_winapi.", "msvcrt.")
_REFUSED_MODULES = frozenset((
    "_posixsubprocess", "_ctypes", "_sqlite3", "_dbm", "_gdbm", "readline", "_posixshmem", "_multiprocessing",
    "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues", "_tkinter",
    "ossaudiodev", "spwd", "nis", "_lsprof"))
_REFUSED_MODULE_PREFIXES = ("_test", "_xx", "xxlimited", "_ctypes")
_WATCHED = frozenset(("open", "import", "os.kill", "os.killpg", "object.__setattr__")
                     + tuple(e for e, _, _ in _PATH_EVENTS)) | _REFUSED_EVENTS

def _make_hook(folder, roots):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    function_type = type(_make_hook)

    def hook(event, args, _watched=_WATCHED, _prefixes=_REFUSED_PREFIXES, _refused=_REFUSED_EVENTS,
             _path_events=_PATH_EVENTS, _modules=_REFUSED_MODULES, _module_prefixes=_REFUSED_MODULE_PREFIXES,
             _folder=folder, _roots=roots, _devices=devices, _write_flags=write_flags, _function=function_type,
             _refusal=_path_refusal, _text=_text, _resolve=_resolve, _within=_within, _type=type,
             _str=str, _int=int, _getpid=os.getpid, _getpgrp=os.getpgrp, _Error=PermissionError):
        if event not in _watched and not event.startswith(_prefixes):
            return
        why = None
        if event in _refused or event.startswith(_prefixes):
            why = "not allowed"
        elif event == "open":
            path, mode, flags = args[0], args[1], args[2]
            write = bool(flags & _write_flags) or (_type(mode) is _str and
                                                   ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if _type(path) is not _int:
                why = _refusal(path, None, write, True, _folder, _roots, _devices)
        elif event == "import":
            name, where = _text(args[0]), args[1]
            if name is None or name in _modules or name.startswith(_module_prefixes):
                why = "importing this module is not allowed"
            elif where is not None:  # an extension module's file
                place = _text(where)
                real = None if place is None or ".." in place.split("/") else _resolve(place, None)
                why = "loading native code from outside Python's installation"
                for root in _roots:
                    if real is not None and _within(real, root):
                        why = None
        elif event == "os.kill":
            if args[0] not in (0, _getpid()):
                why = "signals to other processes are not allowed"
        elif event == "os.killpg":
            if args[0] != _getpgrp():
                why = "signals to other processes are not allowed"
        elif event == "object.__setattr__":
            # the prelude's own functions (the hook's helpers): their code and bound defaults stay as they are
            if (_type(args[0]) is _function and args[1] in ("__code__", "__defaults__", "__kwdefaults__")
                    and args[0].__code__.co_filename == "<sandbox prelude>"):
                why = "changing the sandbox's functions is not allowed"
        else:
            for name, write, paths in _path_events:
                if name == event:
                    for at, dir_at in paths:
                        why = why or _refusal(args[at], None if dir_at is None else args[dir_at], write, False,
                                              _folder, _roots, _devices)
        if why is not None:
            raise _Error("sandbox: " + event + " refused: " + why)

    return hook

def _sandbox_main():
    folder, status_fd = sys.argv[1], int(sys.argv[2])
    memory, files, cpu, open_files, processes = (int(a) for a in sys.argv[3:8])
    # 1. network (ctypes is refused once the hook is in), 2. kernel limits, 3. what no audit event guards
    isolated = _no_network()
    os.write(status_fd, b"%d" % isolated)
    os.close(status_fd)
    _set_limits(memory, files, cpu, open_files, processes)
    _remove_unaudited()
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                           os.path.dirname(os.__file__))}
    roots = tuple(sorted(r for r in roots if r != "/"))
    with open(os.path.join(folder, "main.py"), "rb") as f:
        source = f.read()
    import types
    module = types.ModuleType("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    sys.path.insert(0, folder)
    # 4. the audit hook, last: from here on every guarded event goes through it
    sys.addaudithook(_make_hook(folder, roots))
    return module, source

_prelude = sys.modules["__main__"]
_module, _source = _sandbox_main()
del _sandbox_main, _make_hook, _path_refusal, _resolve, _fd_dir, _within, _text, _no_network, _set_limits, \
    _remove_unaudited
try:
    exec(compile(_source, "main.py", "exec"), _module.__dict__)
except SystemExit:
    raise
except BaseException as _exc:  # the traceback from the code's own frames (not this prelude's)
    _exc = _exc.with_traceback(_exc.__traceback__.tb_next)
    sys.excepthook(type(_exc), _exc, _exc.__traceback__)
    sys.exit(1)
'''

# compiled under its own file name: the hook tells the prelude's functions from the code's by it
BOOTSTRAP = f"exec(compile({PRELUDE!r}, '<sandbox prelude>', 'exec'))"


def run_sandboxed(code: str, timeout_s: float = 5.0, memory_mb: int = 256, output_bytes: int = 8192,
                  files_mb: int = 16) -> SandboxResult:
    """Run `code` as a Python program in the sandbox the module docstring describes, and wait for it (at most
    timeout_s of wall-clock time, plus the time to start and clean up)."""
    if timeout_s <= 0 or memory_mb <= 0 or output_bytes <= 0 or files_mb < 0:
        raise ValueError(f"run_sandboxed: timeout_s, memory_mb and output_bytes must be positive and files_mb "
                         f"not negative (got {timeout_s}, {memory_mb}, {output_bytes}, {files_mb})")
    folder = os.path.realpath(tempfile.mkdtemp(prefix="rlhfkit-sandbox-"))
    status_read = None
    try:
        with open(os.path.join(folder, CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        status_read, status_write = os.pipe()
        limits = [memory_mb << 20, files_mb << 20, math.ceil(timeout_s) + 1, MAX_OPEN_FILES, MAX_PROCESSES]
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", BOOTSTRAP, folder, str(status_write),
                 *map(str, limits)],
                cwd=folder, env=child_environment(folder), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(status_write,), start_new_session=True)
        finally:
            os.close(status_write)
        with proc:
            try:
                (stdout, stderr), truncated, killed_reason = read_until_done(proc, timeout_s, output_bytes)
            finally:
                if proc.poll() is None:  # an error in the parent while it ran: never leave it behind
                    kill_group(proc)
                proc.wait()
        exit_code = proc.returncode
        if killed_reason is None and exit_code < 0:  # a limit the kernel enforces
            killed_reason = "cpu time" if exit_code == -signal.SIGXCPU else f"signal {signal.Signals(-exit_code).name}"
        return SandboxResult(stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), exit_code,
                             killed_reason in ("timeout", "cpu time"), truncated, killed_reason,
                             os.read(status_read, 8) == b"1")
    finally:
        if status_read is not None:
            os.close(status_read)
        remove_folder(folder)


def child_environment(folder: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": folder, "TMPDIR": folder,
            "PYTHONDONTWRITEBYTECODE": "1"}


def read_until_done(proc: subprocess.Popen, timeout_s: float, cap: int) -> tuple[tuple[bytes, bytes], bool, str | None]:
    """((stdout, stderr), truncated, killed_reason): read both pipes as they fill (a child blocked on a full pipe
    would never exit), keep the first `cap` bytes of stdout and the last `cap` of stderr, kill the process group
    at the deadline or when a stream passes FLOOD_FACTOR * cap."""
    deadline = time.monotonic() + timeout_s
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {out: bytearray(), err: bytearray()}
    seen = dict.fromkeys(kept, 0)
    killed_reason = None
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and killed_reason is None:
            left = deadline - time.monotonic()
            if left <= 0:
                killed_reason = "timeout"
                break
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                seen[key.fd] += len(chunk)
                if key.fd == err:  # the end of stderr, where a traceback says what went wrong
                    kept[err] = (kept[err] + chunk)[-cap:]
                else:
                    kept[key.fd] += chunk[:max(cap - len(kept[key.fd]), 0)]
                if seen[key.fd] > FLOOD_FACTOR * cap:
                    killed_reason = "output flood"
    if killed_reason is None:  # both pipes closed: the process is exiting, or closed them and runs on
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            killed_reason = "timeout"
    if killed_reason is not None:
        kill_group(proc)
    truncated = any(n > cap for n in seen.values())
    return (bytes(kept[out]), bytes(kept[err])), truncated, killed_reason


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (its own session) and the child itself, while it is still unreaped."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except ProcessLookupError:
            pass


def remove_folder(folder: str) -> None:
    """Remove the run's folder, even where the code took away its own permissions on it or a subfolder."""
    try:
        os.chmod(folder, 0o700)
    except FileNotFoundError:  # the code emptied and removed it itself
        return
    for root, dirs, _ in os.walk(folder):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def network_isolation_available() -> bool:
    """Whether sandboxed code gets its own empty network namespace on this machine (checked once, by a run)."""
    return run_sandboxed("", timeout_s=10.0).network_isolated


def code_tool(timeout_s: float = 5.0, memory_mb: int = 256, output_bytes: int = 8192) -> Tool:
    """The "python" tool: runs the code it is given in `run_sandboxed` and returns what it printed, with a short
    tail of stderr and a note when it failed, timed out or printed too much."""

    def run_python(code: str) -> str:
        return tool_output(run_sandboxed(code, timeout_s, memory_mb, output_bytes), timeout_s, output_bytes)

    return Tool(
        name="python",
        description="Run a Python program (standard library only, no network, no files outside its own folder) "
                    "and see what it prints. Use print() to show results.",
        parameters={"type": "object",
                    "properties": {"code": {"type": "string", "description": "the whole program"}},
                    "required": ["code"]},
        fn=run_python,
    )


STDERR_TAIL = 600  # characters of stderr the tool shows: a traceback's last lines, where its error is


def tool_output(result: SandboxResult, timeout_s: float, output_bytes: int) -> str:
    """What the model sees: stdout, then any stderr's tail and one "error: ..." line per problem."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        tail = result.stderr.strip()
        tail = tail if len(tail) <= STDERR_TAIL else "..." + tail[-STDERR_TAIL:]
        parts.append(f"stderr:\n{tail}")
    if result.timed_out:
        parts.append(f"error: timed out after {timeout_s:g}s")
    elif result.killed_reason:
        parts.append(f"error: killed ({result.killed_reason})")
    elif result.exit_code != 0:
        parts.append(f"error: exit code {result.exit_code}")
    if result.truncated:
        parts.append(f"error: output truncated to {output_bytes} bytes")
    return "\n".join(parts) or "(no output)"
