"""The code tool: model-written Python run in a separate, confined process. Off unless a user lists "python".

`run_sandboxed` runs the code in one of two ways (`sandbox`):

- "kernel" (the default, and the only one a run uses unless its config says otherwise): behind the kernel
  boundary of tools/boundary.py (user, mount, PID, network and IPC namespaces; a read-only view of the interpreter
  and its libraries; a private size-bounded tmpfs as its folder; a seccomp filter; rlimits), with the audit hook of
  tools/audit_layer.py inside as a second layer. `kernel_boundary_problem()` says why it cannot run on a machine
  (no unprivileged namespaces, no libseccomp), or None.
- "hook": where the kernel offers no namespaces and the user opts in (`episode.code_sandbox=hook`): the same
  child, rlimits, seccomp filter (where libseccomp is) and audit hook, in a temporary host folder. An audit hook is
  not a security boundary (PEP 578): model code can run whatever the hook misses, as the trainer's user.

Either way the child is `python -I -S -B -X utf8` (isolated mode, standard library only, no bytecode written) with
an environment of PATH, LANG, HOME, TMPDIR and PYTHONDONTWRITEBYTECODE only. The parent reads stdout and stderr
concurrently, keeps output_bytes of each (stdout's start, stderr's end; the rest is counted and dropped:
`truncated`), kills the whole process group when the wall-clock timeout passes or a stream runs past 4x the cap,
waits until the child's output pipes close (so nothing of it runs on), and never holds more than that in memory.
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from rlhfkit.tools import boundary
from rlhfkit.tools.audit_layer import BOOTSTRAP
from rlhfkit.tools.function import Tool

FLOOD_FACTOR = 4  # a stream this many times past its cap gets the process killed
MAX_PROCESSES = 16  # threads, counted by the kernel per user namespace (no process can fork: seccomp)
MAX_OPEN_FILES = 64
CODE_FILE = "main.py"
SANDBOXES = ("kernel", "hook")
SETUP_FAILED = 125  # the exit code of a run whose boundary could not be built (nothing of the code ran)
REAP_S = 5.0  # after a kill, how long the parent waits for the child's output pipes to close


@dataclass
class SandboxResult:
    """What a sandboxed run printed and how it ended.

    stdout, stderr: the first output_bytes of stdout and the last of stderr (where a traceback's error is),
    decoded as UTF-8 (undecodable bytes replaced);
    exit_code: the process's exit status, or minus the signal that killed it (as subprocess reports it);
    timed_out: it ran past the wall-clock timeout or its CPU-time limit and was killed;
    truncated: a stream had more than output_bytes (the rest was dropped);
    killed_reason: why it was killed ("timeout", "output flood", "cpu time", "signal SIGxxx") or why it could not
    start ("sandbox set-up failed: ..."), None if it exited by itself;
    confined: it ran behind the kernel boundary (tools/boundary.py); False for sandbox="hook".
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool
    killed_reason: str | None
    confined: bool = False


def run_sandboxed(code: str, timeout_s: float = 5.0, memory_mb: int = 256, output_bytes: int = 8192,
                  files_mb: int = 16, sandbox: str = "kernel", audit_hook: bool = True) -> SandboxResult:
    """Run `code` as a Python program in the sandbox the module docstring describes, and wait for it (at most
    timeout_s of wall-clock time, plus the time to start and clean up). files_mb bounds each file and, behind the
    kernel boundary, all files together. audit_hook=False leaves the second layer out (the tests use it to show
    that the kernel boundary holds by itself)."""
    if timeout_s <= 0 or memory_mb <= 0 or output_bytes <= 0 or files_mb < 0:
        raise ValueError(f"run_sandboxed: timeout_s, memory_mb and output_bytes must be positive and files_mb "
                         f"not negative (got {timeout_s}, {memory_mb}, {output_bytes}, {files_mb})")
    if sandbox not in SANDBOXES:
        raise ValueError(f"run_sandboxed: sandbox must be one of {', '.join(SANDBOXES)}, got {sandbox!r}")
    confined = sandbox == "kernel"
    folder = os.path.realpath(tempfile.mkdtemp(prefix="rlhfkit-sandbox-"))
    status_read = None
    try:
        with open(os.path.join(folder, CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        status_read, status_write = os.pipe()
        inside = boundary.SANDBOX_DIR if confined else folder
        bpf = boundary.seccomp_program() if confined or seccomp_usable() else b""
        limits = [memory_mb << 20, files_mb << 20, math.ceil(timeout_s) + 1, MAX_OPEN_FILES, MAX_PROCESSES]
        child = [boundary.interpreter(), "-I", "-S", "-B", "-X", "utf8", "-c", BOOTSTRAP, inside,
                 *map(str, limits), bpf.hex(), "1" if audit_hook else "0", boundary.extension_folder()]
        if confined:
            command = boundary.launcher_command(folder, child, child_environment(inside), status_write,
                                                files_mb << 20)
        else:
            command = child
        try:
            proc = subprocess.Popen(command, cwd="/" if confined else folder, env=child_environment(inside),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(status_write,), start_new_session=True)
        finally:
            os.close(status_write)
        stop = stop_launcher if confined else kill_group
        with proc:
            try:
                (stdout, stderr), truncated, killed_reason = read_until_done(proc, timeout_s, output_bytes, stop)
            finally:
                if proc.poll() is None:  # an error in the parent while it ran: never leave it behind
                    stop(proc)
                proc.wait()
        exit_code, confined_ran, problem = read_status(status_read, proc.returncode, confined)
        if problem is not None:
            killed_reason = f"sandbox set-up failed: {problem}"
        elif killed_reason is None and exit_code < 0:  # a limit the kernel enforces
            killed_reason = "cpu time" if exit_code == -signal.SIGXCPU else f"signal {signal.Signals(-exit_code).name}"
        return SandboxResult(stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), exit_code,
                             killed_reason in ("timeout", "cpu time"), truncated, killed_reason, confined_ran)
    finally:
        if status_read is not None:
            os.close(status_read)
        remove_folder(folder)


def read_status(fd: int, returncode: int, confined: bool) -> tuple[int, bool, str | None]:
    """(exit code, whether the boundary was built, the set-up's error or None) from the launcher's status lines
    (tools/boundary.py); without the boundary, the child's own return code."""
    if not confined:
        return returncode, False, None
    os.set_blocking(fd, False)
    try:
        lines = os.read(fd, 1 << 16).decode("utf-8", "replace").splitlines()
    except BlockingIOError:
        lines = []
    built = "boundary" in lines
    errors = [line[6:] for line in lines if line.startswith("error ")]
    exits = [int(line[5:]) for line in lines if line.startswith("exit ")]
    if errors and not built:
        return SETUP_FAILED, False, errors[0]
    if exits:
        return os.waitstatus_to_exitcode(exits[-1]), built, None
    return -signal.SIGKILL, built, None  # stopped before it could report (the timeout, a flood): killed


def child_environment(folder: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": folder, "TMPDIR": folder,
            "PYTHONDONTWRITEBYTECODE": "1"}


def read_until_done(proc: subprocess.Popen, timeout_s: float, cap: int,
                    stop=None) -> tuple[tuple[bytes, bytes], bool, str | None]:
    """((stdout, stderr), truncated, killed_reason): read both pipes as they fill (a child blocked on a full pipe
    would never exit), keep the first `cap` bytes of stdout and the last `cap` of stderr, `stop` the run (default:
    kill its process group) at the deadline or when a stream passes FLOOD_FACTOR * cap, then wait (at most REAP_S)
    until the pipes close: only an ended child closes them, so nothing of it runs on."""
    stop = stop or kill_group
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
            stop(proc)
            drain_until_closed(selector, time.monotonic() + REAP_S)
    truncated = any(n > cap for n in seen.values())
    return (bytes(kept[out]), bytes(kept[err])), truncated, killed_reason


def drain_until_closed(selector: selectors.BaseSelector, deadline: float) -> None:
    """Read and drop what the registered pipes still carry until each closes or the deadline passes."""
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(max(deadline - time.monotonic(), 0)):
            if not os.read(key.fd, 65536):
                selector.unregister(key.fd)


def stop_launcher(proc: subprocess.Popen) -> None:
    """Stop a run behind the kernel boundary: SIGTERM to the launcher, which kills the namespaces' parent (PID 1
    dies with it, and the namespace with PID 1), reaps both and exits; SIGKILL to its whole process group if it
    has not within REAP_S (the processes then left to the system's init to reap)."""
    try:
        proc.terminate()
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (its own session) and the child itself, while it is still unreaped."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except ProcessLookupError:
            pass


def remove_folder(folder: str) -> None:
    """Remove the run's folder and everything under it, however deep (no recursion: a thousand nested folders are
    no RecursionError) and wherever the code took away its own permissions. File descriptors relative to each
    folder, so paths longer than PATH_MAX are removed too."""
    try:
        os.chmod(folder, 0o700)
        top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:  # the code emptied and removed it itself
        return
    stack = [(top, None)]  # (an open folder, its name in the folder below it on the stack)
    try:
        while stack:
            fd = stack[-1][0]
            entered = False
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        os.chmod(entry.name, 0o700, dir_fd=fd, follow_symlinks=False)
                        stack.append((os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                              dir_fd=fd), entry.name))
                        entered = True
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if not entered:  # empty now: remove it from the folder it is in
                fd, name = stack.pop()
                os.close(fd)
                if stack:
                    os.rmdir(name, dir_fd=stack[-1][0])
    finally:
        for fd, _ in stack:
            os.close(fd)
    os.rmdir(folder)


@functools.cache
def seccomp_usable() -> bool:
    """Whether libseccomp compiles the filter here (the hook-only sandbox uses it where it can)."""
    try:
        boundary.seccomp_program()
    except OSError:
        return False
    return True


@functools.cache
def kernel_boundary_problem() -> str | None:
    """Why the kernel boundary cannot be built on this machine (one line), or None when it can (checked once per
    process, by a run)."""
    try:
        boundary.seccomp_program()
        result = run_sandboxed("print('ok')", timeout_s=20.0)
    except OSError as exc:
        return str(exc)
    if result.killed_reason and result.killed_reason.startswith("sandbox set-up failed"):
        return result.killed_reason.removeprefix("sandbox set-up failed: ")
    if not result.confined or result.stdout != "ok\n":
        return f"a trial run did not come back as expected (exit code {result.exit_code}): {result.stderr[-200:]}"
    return None


def code_tool(timeout_s: float = 5.0, memory_mb: int = 256, output_bytes: int = 8192,
              sandbox: str = "kernel") -> Tool:
    """The "python" tool: runs the code it is given in `run_sandboxed` and returns what it printed, with a short
    tail of stderr and a note when it failed, timed out or printed too much. With sandbox="kernel" it raises
    OSError when this machine cannot build the kernel boundary (the message says how to opt out)."""
    if sandbox == "kernel":
        problem = kernel_boundary_problem()
        if problem is not None:
            raise OSError(f"the python tool runs model-written code behind a kernel boundary (namespaces, seccomp), "
                          f"which this machine cannot build: {problem}. Set episode.code_sandbox=hook to run it "
                          f"behind an in-process audit hook only, which is not a security boundary "
                          f"(docs/agents.md#the-code-tool)")

    def run_python(code: str) -> str:
        return tool_output(run_sandboxed(code, timeout_s, memory_mb, output_bytes, sandbox=sandbox), timeout_s,
                           output_bytes)

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
