"""The kernel boundary around model-written code (the "python" tool): what the kernel, not Python, enforces.

Each call starts `LAUNCHER` (a small trusted Python program) with the child's command. It forks a process that
unshares new user, mount, PID, network, IPC, UTS and cgroup namespaces; the launcher writes that namespace's
uid/gid maps from outside (so a root trainer can map root for the set-up and an unprivileged id for the code). The
process then forks the code's process, PID 1 of the new PID namespace, which builds a root of its own and enters it:

- a small read-only tmpfs as `/`, holding only read-only binds of what the interpreter needs (`view()`: its
  executable, its standard library, libpython, the system's shared-library folders, the loader's cache) and the
  devices null, zero, random and urandom; every `site-packages` and `dist-packages` folder inside them is covered
  by an empty read-only tmpfs, so no third-party package (cffi, ...) can be imported;
- `/sandbox` (also `/tmp`): a private tmpfs of `files_mb` (plus the code), at most `MAX_INODES` files and folders,
  noexec, nosuid, nodev: the only place it can write, and gone with the namespace;
- its own /proc (only its own processes);

then `pivot_root`s into it, detaches the old root, drops to an unprivileged id (65534 when the trainer is root; the
trainer's own otherwise), loses every capability at `execve`, sets no_new_privs and a parent-death signal, and
starts the child. The child's prelude (tools/audit_layer.py) sets the rlimits and loads the seccomp filter
(`seccomp_program()`, compiled by libseccomp) before the code runs.

What this gives: nothing of the host's file system but the read-only view; no network (an empty network
namespace, and no sockets but AF_UNIX); no other process visible or reachable (it is PID 1 of its own namespace;
ptrace, process_vm_*, pidfd_*, kcmp refused); no new process at all (clone without CLONE_THREAD, fork, vfork,
execve refused), so nothing outlives the call: when PID 1 ends, the kernel ends the namespace; no kernel surface
that a sandboxed program has no use for (mount, bpf, keyctl, perf_event_open, userfaultfd, io_uring, modules,
memfd_create, SysV and POSIX IPC, name_to_handle_at/open_by_handle_at, ...). Limits the kernel enforces: address
space, CPU seconds, file size, open files, threads (RLIMIT_NPROC, counted per user namespace), total disk and files
(the tmpfs). What it does not: a kernel exploit through the system calls left open (the same as any container).
"""

from __future__ import annotations

import errno
import functools
import glob
import marshal
import os
import sys
import sysconfig
from dataclasses import dataclass

SANDBOX_DIR = "/sandbox"  # the code's folder inside the boundary: its cwd, HOME and TMPDIR (/tmp points here)
UNPRIVILEGED_ID = 65534  # the id the code runs as when the trainer is root (nobody / nogroup)
MAX_INODES = 4096  # files and folders the code may make in its tmpfs
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")
FILES = ("/etc/ld.so.cache",)
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

# refused with EPERM; the names libseccomp does not know on this architecture are skipped
DENIED_SYSCALLS = (
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
    # new processes and programs (threads stay: clone with CLONE_THREAD, below)
    "fork", "vfork", "execve", "execveat",
    # namespaces, mounts and roots
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel surface a Python program has no use for
    "bpf", "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "syslog", "personality", "modify_ldt", "lookup_dcookie",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init", "iopl", "ioperm", "uselib", "vhangup",
    "sethostname", "setdomainname", "mknod", "mknodat",
    # memory outside the address-space limit, and shared memory or queues between processes
    "memfd_create", "memfd_secret", "shmget", "shmat", "msgget", "semget", "mq_open")
CLONE_THREAD = 0x00010000
AF_UNIX = 1
TTY_IOCTLS = (0x5412, 0x541C)  # TIOCSTI (type into a terminal), TIOCLINUX


@dataclass(frozen=True)
class View:
    """What the code's root holds. python: the interpreter started inside; steps: ("bind", host path) read-only,
    ("device", path), ("symlink", path, target), ("hide", path: an empty read-only tmpfs over it), in order;
    pivot_root: that system call's number on this architecture."""

    python: str
    steps: tuple
    pivot_root: int


def _libseccomp():
    """libseccomp's Python binding: the official `seccomp` module where installed, else `pyseccomp` (the same API
    over ctypes, a dependency of rlhfkit). Raises OSError naming what is missing."""
    try:
        import seccomp
    except ImportError:
        try:
            import pyseccomp as seccomp
        except (ImportError, OSError) as exc:  # pyseccomp raises at import when libseccomp.so.2 is missing
            raise OSError(f"libseccomp is not usable here ({exc}); install libseccomp2 (apt-get install "
                          f"libseccomp2)") from None
    return seccomp


@functools.cache
def seccomp_program() -> bytes:
    """The seccomp filter as raw BPF (compiled once per process by libseccomp): allow by default, EPERM for
    `DENIED_SYSCALLS`, for clone without CLONE_THREAD (a new process), socket() of any family but AF_UNIX and the
    terminal ioctls; ENOSYS for clone3 (its flags sit in memory a filter cannot read, and the C library falls back
    to clone); a system call of another architecture kills the process."""
    seccomp = _libseccomp()
    program = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    program.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    refuse = seccomp.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            program.add_rule(refuse, name)
        except (ValueError, OSError, RuntimeError):  # not a system call on this architecture
            continue
    program.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    program.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    for request in TTY_IOCTLS:
        program.add_rule(refuse, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as out:
            program.export_bpf(out)
        with os.fdopen(read, "rb") as source:
            read = None
            return source.read()
    finally:
        if read is not None:
            os.close(read)


def interpreter() -> str:
    """The base interpreter (a virtual environment's python is a link to it, and its packages stay outside)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def extension_folder() -> str:
    """The standard library's folder of extension modules (lib-dynload): the only native code the hook lets in."""
    return os.path.realpath(sysconfig.get_config_var("DESTSHARED") or os.path.join(os.path.dirname(os.__file__),
                                                                                   "lib-dynload"))


def _expose(path: str, links: list, binds: list) -> None:
    """Record what shows `path` inside: each symbolic link on the way (as a link), then the real place (a bind)."""
    parts = [p for p in path.split("/") if p]
    here = ""
    for i, part in enumerate(parts):
        step = here + "/" + part
        if os.path.islink(step):
            target = os.readlink(step)
            links.append((step, target))
            _expose(os.path.normpath(os.path.join(here or "/", target, *parts[i + 1:])), links, binds)
            return
        here = step
    if here and os.path.exists(here):
        binds.append(here)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@functools.cache
def view() -> View:
    """The read-only view of the host the code gets (see the module docstring), planned once per process."""
    python = interpreter()
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    wanted = [python, stdlib, *LIBRARY_DIRS, *FILES]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        wanted.append(os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var(
            "INSTSONAME") or ""))
    links, found = [], []
    for path in wanted:
        _expose(path, links, found)
    binds = []
    for path in sorted(set(found), key=len):  # a folder before what it holds; what a bound folder holds is shown
        if not any(_within(path, bound) for bound in binds):
            binds.append(path)
    steps = [("bind", path) for path in binds]
    steps += [("device", path) for path in DEVICES if os.path.exists(path)]
    seen = set()
    for path, target in links:  # a link inside a bound folder is already there
        if path not in seen and not any(_within(path, bound) for bound in binds):
            seen.add(path)
            steps.append(("symlink", path, target))
    hidden = set()
    for bound in binds:
        if os.path.isdir(bound):
            for pattern in ("site-packages", "dist-packages", "python*/site-packages", "python*/dist-packages",
                            "python*/*/site-packages"):
                hidden.update(p for p in glob.glob(os.path.join(bound, pattern)) if os.path.isdir(p))
    steps += [("hide", path) for path in sorted(hidden)]
    steps.append(("symlink", "/tmp", SANDBOX_DIR))
    seccomp = _libseccomp()
    return View(python, tuple(steps), seccomp.resolve_syscall(seccomp.system_arch(), "pivot_root"))


def launcher_command(mount_point: str, child: list, env: dict, status_fd: int, sandbox_bytes: int) -> list:
    """The command that runs `child` (an argv whose program is `view().python`) behind the boundary. mount_point:
    an empty host folder holding main.py (read, then covered by the code's root inside the namespace)."""
    plan = view()
    config = {"parent": os.getpid(), "status_fd": status_fd, "mount_point": mount_point, "steps": plan.steps,
              "pivot_root": plan.pivot_root, "id": UNPRIVILEGED_ID, "sandbox": SANDBOX_DIR,
              "sandbox_bytes": sandbox_bytes, "inodes": MAX_INODES, "child": child, "env": env}
    # marshal: the launcher reads it with no import (json's costs it more time than all its mounts)
    return [plan.python, "-I", "-S", "-B", "-c", LAUNCHER, marshal.dumps(config).hex()]


# The launcher (trusted code, before any of the model's): see the module docstring. It reports on the status
# file descriptor, one line each: "boundary" (the root is built; the child starts), "error TEXT" (the set-up failed:
# nothing of the model's ran), "exit STATUS" (the child's wait status). SIGTERM stops the run (`launcher()`).
LAUNCHER = r'''
import ctypes, marshal, os, signal, sys

cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
STATUS = cfg["status_fd"]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 16384, 1 << 18, 1 << 21
# user, mount, PID, network, IPC, UTS and cgroup namespaces
NAMESPACES = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000 | 0x02000000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, SIGKILL, MNT_DETACH = 1, 36, 38, 9, 2
# a bind's flags that a user namespace may not clear, from the source's statvfs
KEPT = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

def say(line):
    os.write(STATUS, (line + "\n").encode())

def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), "mount " + target)

def die_with_parent():
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl")

def build_root(root, code, uid):
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for step in cfg["steps"]:
        kind, path, place = step[0], step[1], root + step[1]
        if kind == "symlink":
            os.makedirs(os.path.dirname(place), exist_ok=True)
            os.symlink(step[2], place)
        elif kind in ("bind", "device"):
            if os.path.isdir(path):
                os.makedirs(place, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(place), exist_ok=True)
                open(place, "ab").close()
            mount(path, place, None, MS_BIND)
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (MS_NODEV if kind == "bind" else MS_NOEXEC)
            kept = os.statvfs(path).f_flag
            mount(None, place, None, flags | sum(ms for st, ms in KEPT if kept & st))
        elif kind == "hide":
            mount("tmpfs", place, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=2,mode=0555")
    work = root + cfg["sandbox"]
    os.makedirs(work)
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=%d,nr_inodes=%d,mode=0700,uid=%d,gid=%d"
          % (cfg["sandbox_bytes"] + len(code) + 4096, cfg["inodes"], uid[0], uid[1]))
    with open(work + "/main.py", "wb") as f:
        f.write(code)
    os.chown(work + "/main.py", uid[0], uid[1])
    os.makedirs(root + "/proc")
    try:  # its own /proc: its processes only (where the host's /proc is not masked; else it has none)
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.chdir(root)
    check(libc.syscall(cfg["pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount of the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(cfg["sandbox"])

def code_process(alive, root_mapped):
    """PID 1 of the new namespace: build the root, become unprivileged, start the child."""
    die_with_parent()
    with open(cfg["mount_point"] + "/main.py", "rb") as f:
        code = f.read()
    uid = (cfg["id"], cfg["id"]) if root_mapped else (os.getuid(), os.getgid())
    build_root(cfg["mount_point"], code, uid)
    if root_mapped:
        os.setgroups([])
        os.setresgid(uid[1], uid[1], uid[1])
        os.setresuid(uid[0], uid[0], uid[0])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
    die_with_parent()  # again: a change of credentials clears it
    os.setsid()
    os.set_blocking(alive, False)
    try:
        os.read(alive, 1)
        raise OSError("the sandbox's parent ended during its set-up")
    except BlockingIOError:  # the parent still holds the pipe's other end
        pass
    say("boundary")
    os.closerange(3, 1 << 16)
    os.execve(cfg["child"][0], cfg["child"], cfg["env"])

def namespace_parent(go, ready):
    """Unshare the namespaces, wait for the maps, fork PID 1 of the new PID namespace and report its exit."""
    die_with_parent()
    check(libc.unshare(NAMESPACES), "unshare (the kernel refuses unprivileged namespaces here)")
    os.write(ready, b"u")
    os.close(ready)
    if os.read(go, 1) != b"m":
        os._exit(125)
    os.close(go)
    alive_read, alive_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_write)
        try:
            code_process(alive_read, os.geteuid() == 0)
        except BaseException as exc:
            say("error " + " ".join(str(exc).split()))
        os._exit(125)
    os.close(alive_read)
    status = os.waitpid(pid, 0)[1]
    say("exit %d" % status)

def write_maps(pid):
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:  # root maps root for the set-up and an unprivileged id for the code
        maps = ("0 0 1\n%d %d 1\n" % (cfg["id"], cfg["id"]),) * 2
    else:  # anyone else maps only themselves
        with open("/proc/%d/setgroups" % pid, "w") as f:
            f.write("deny")
        maps = ("%d %d 1\n" % (uid, uid), "%d %d 1\n" % (gid, gid))
    for name, text in zip(("uid_map", "gid_map"), maps):
        with open("/proc/%d/%s" % (pid, name), "w") as f:
            f.write(text)

def launcher():
    """Start the namespaces' parent and reap every process of the run: it is their subreaper, so a PID 1 whose
    parent died comes back to it. SIGTERM (the trainer's stop) kills the namespaces' parent, whose death kills
    PID 1, whose death ends the namespace; then it reaps them and exits."""
    signal.signal(signal.SIGTERM, on_stop)
    die_with_parent()  # the trainer's thread that started it waits for it: it ends only if the trainer dies
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl")
    if os.getppid() != cfg["parent"]:
        os._exit(125)
    go_read, go_write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(go_write)
        os.close(ready_read)
        try:
            namespace_parent(go_read, ready_write)
        except BaseException as exc:
            say("error " + " ".join(str(exc).split()))
        os._exit(0)
    os.close(go_read)
    os.close(ready_write)
    try:
        if os.read(ready_read, 1) == b"u":
            write_maps(pid)
            os.write(go_write, b"m")
    except BaseException as exc:
        say("error uid map: " + " ".join(str(exc).split()))
    os.close(go_write)
    child.append(pid)
    if stopped:
        stop_child()
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # none left
            break

child, stopped = [], []

def stop_child():
    for pid in child:  # not reaped yet (only the loop above reaps): the pid is still this child's
        os.kill(pid, SIGKILL)

def on_stop(*_):
    stopped.append(True)
    stop_child()

launcher()
'''
