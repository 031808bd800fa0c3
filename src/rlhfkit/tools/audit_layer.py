"""The code tool's layers inside the child Python, before the model's code runs (the kernel boundary around it is
tools/boundary.py; tools/sandbox.py starts both).

`BOOTSTRAP` runs `PRELUDE` in the child (`python -I -S -B -X utf8 -c BOOTSTRAP folder limits... bpf hook native`);
it sets up, in this order:

1. kernel limits: address space (memory_mb), file size (files_mb), CPU seconds (the timeout + 1), 64 open files,
   16 processes or threads, no core dumps;
2. the seccomp filter (tools/boundary.py compiles it with libseccomp; given as hex), loaded with no_new_privs: from
   here on the kernel refuses the system calls it lists, to this process and all it could start;
3. `_posixsubprocess.fork_exec`, and os/signal functions that raise no audit event and act on other processes or
   make special files, removed from the modules;
4. an audit hook (`sys.addaudithook`; it cannot be removed) raising PermissionError("sandbox: ...") for writing
   outside the folder, reading outside it and the standard library, '..' in paths, links, sockets, processes,
   signals to others, ctypes, rlimits, subinterpreters, gc's object graph, tracing other frames, swapping the code of the
   hook's helpers, and importing modules whose C code acts without audit events (by name and by file name, so an
   alias does not pass) or native code from outside the standard library. It blocks signals while it checks a
   path, so a signal handler cannot edit its state half-way.

The hook is a second layer only: an audit hook is not a security boundary (PEP 578 says so). Run alone
(`episode.code_sandbox=hook`, where the kernel offers no namespaces) it stops the escapes known to us, not all.
"""

from __future__ import annotations

# Runs in the child with the arguments folder, memory_bytes, file_bytes, cpu_s, open_files, processes, bpf_hex,
# hook (1 or 0), native (the standard library's folder of extension modules), before the code in folder/main.py. Everything the audit hook and its helpers use is bound as a
# default argument (immutable), so code which patches modules or builtins cannot change what the hook checks.
PRELUDE = r'''
import os, sys, resource

def _set_limits(memory, files, cpu, open_files, processes):
    for which, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_FSIZE, files, files),
                              (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL after
                              (resource.RLIMIT_NOFILE, open_files, open_files),
                              (resource.RLIMIT_NPROC, processes, processes), (resource.RLIMIT_CORE, 0, 0)):
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:  # a limit can only be lowered
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))

def _load_seccomp(bpf):
    """prctl(PR_SET_NO_NEW_PRIVS), then prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, the compiled program)."""
    import ctypes
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    code = ctypes.create_string_buffer(bpf, len(bpf))
    program = Program(len(bpf) // 8, ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: loading the seccomp filter failed")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]

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
    """The absolute path `path` (relative to `base`, or the cwd when base is None) names, symlinks followed. The
    hook calls it with every signal blocked, so no handler can edit its lists half-way."""
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
            target = _readlink(here)
            if target.startswith("/"):
                parts = []
            more = target.split("/")
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

def _path_refusal(path, dir_fd, write, is_open, folder, roots, hidden, devices, _type=type, _int=int, _text=_text,
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
            for place in hidden:
                if _within(real, place):
                    return "reading packages outside the standard library"
            try:
                directory = _stat(real).st_mode & 0o170000 == 0o040000
            except _OSError:
                directory = False
            return "opening a directory outside the sandbox folder" if is_open and directory else None
    return "reading outside the sandbox folder and Python's standard library"

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
    "sqlite3.connect", "sqlite3.load_extension", "sqlite3.enable_load_extension", "sys.remote_exec",
    "sys._current_frames", "sys.settrace", "sys.setprofile"))
_REFUSED_PREFIXES = ("socket.", "ctypes.", "syslog.", "webbrowser.", "winreg.", "_winapi.", "msvcrt.")
# refused by module name and by an extension file's name: a module loaded under another name is the same code
_REFUSED_MODULES = frozenset((
    "_posixsubprocess", "_ctypes", "_sqlite3", "_dbm", "_gdbm", "readline", "_posixshmem", "_multiprocessing",
    "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues", "_tkinter",
    "ossaudiodev", "spwd", "nis", "_lsprof", "_cffi_backend",
    # loaded by the prelude, with functions removed: a second copy would bring them back
    "posix", "_signal"))
_REFUSED_MODULE_PREFIXES = ("_test", "_xx", "xxlimited", "_ctypes")
_WATCHED = frozenset(("open", "import", "os.kill", "os.killpg", "object.__setattr__")
                     + tuple(e for e, _, _ in _PATH_EVENTS)) | _REFUSED_EVENTS

def _module_refused(name, modules, prefixes):
    last = name.rpartition(".")[2]
    return last in modules or last.startswith(prefixes) or name in modules or name.startswith(prefixes)

def _make_hook(folder, roots, hidden, native):
    import signal
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    function_type = type(_make_hook)

    def hook(event, args, _watched=_WATCHED, _prefixes=_REFUSED_PREFIXES, _refused=_REFUSED_EVENTS,
             _path_events=_PATH_EVENTS, _modules=_REFUSED_MODULES, _module_prefixes=_REFUSED_MODULE_PREFIXES,
             _folder=folder, _roots=roots, _hidden=hidden, _native=native, _devices=devices,
             _write_flags=write_flags, _function=function_type, _refusal=_path_refusal, _text=_text,
             _resolve=_resolve, _within=_within, _module_refused=_module_refused, _type=type, _str=str, _int=int,
             _getpid=os.getpid, _getpgrp=os.getpgrp, _Error=PermissionError, _mask=signal.pthread_sigmask,
             _block=signal.SIG_BLOCK, _restore=signal.SIG_SETMASK, _all=frozenset(signal.valid_signals()),
             _check_paths=_check_paths):
        if event not in _watched and not event.startswith(_prefixes):
            return
        why = None
        if event in _refused or event.startswith(_prefixes):
            why = "not allowed"
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
            # a signal handler runs between any two bytecodes: none may run while a path is checked
            before = _mask(_block, _all)
            try:
                why = _check_paths(event, args, _folder, _roots, _hidden, _native, _devices, _write_flags,
                                   _path_events, _modules, _module_prefixes, _refusal, _text, _resolve, _within,
                                   _module_refused, _type, _str, _int)
            finally:
                _mask(_restore, before)
        if why is not None:
            raise _Error("sandbox: " + event + " refused: " + why)

    return hook

def _check_paths(event, args, folder, roots, hidden, native, devices, write_flags, path_events, modules,
                 module_prefixes, refusal, text, resolve, within, module_refused, _type, _str, _int):
    if event == "open":
        path, mode, flags = args[0], args[1], args[2]
        write = bool(flags & write_flags) or (_type(mode) is _str and
                                              ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
        if _type(path) is not _int:
            return refusal(path, None, write, True, folder, roots, hidden, devices)
        return None
    if event == "import":
        name, where = text(args[0]), args[1]
        if name is None or module_refused(name, modules, module_prefixes):
            return "importing this module is not allowed"
        if where is not None:  # an extension module's file: lib-dynload's own, under a name it may have
            place = text(where)
            real = None if place is None or ".." in place.split("/") else resolve(place, None)
            if real is None or not within(real, native):
                return "loading native code from outside Python's standard library"
            if module_refused(real.rpartition("/")[2].partition(".")[0], modules, module_prefixes):
                return "importing this module is not allowed"
        return None
    why = None
    for name, write, paths in path_events:
        if name == event:
            for at, dir_at in paths:
                why = why or refusal(args[at], None if dir_at is None else args[dir_at], write, False,
                                     folder, roots, hidden, devices)
    return why

def _sandbox_main():
    folder = sys.argv[1]
    memory, files, cpu, open_files, processes = (int(a) for a in sys.argv[2:7])
    bpf, with_hook, native = bytes.fromhex(sys.argv[7]), sys.argv[8] == "1", os.path.realpath(sys.argv[9])
    # 1. kernel limits, 2. the seccomp filter, 3. what no audit event guards
    _set_limits(memory, files, cpu, open_files, processes)
    if bpf:
        _load_seccomp(bpf)
    _remove_unaudited()
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    roots = (stdlib,)
    hidden = tuple(p for p in (stdlib + "/site-packages", stdlib + "/dist-packages"))
    with open(os.path.join(folder, "main.py"), "rb") as f:
        source = f.read()
    import types
    module = types.ModuleType("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    sys.path.insert(0, folder)
    # 4. the audit hook, last: from here on every guarded event goes through it
    if with_hook:
        sys.addaudithook(_make_hook(folder, roots, hidden, native))
    return module, source

_prelude = sys.modules["__main__"]
_module, _source = _sandbox_main()
del _sandbox_main, _make_hook, _path_refusal, _resolve, _fd_dir, _within, _text, _set_limits, _load_seccomp, \
    _remove_unaudited, _check_paths, _module_refused
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
