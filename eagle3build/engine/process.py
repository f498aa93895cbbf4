"""Server processes started beside the shard jobs (the HF extraction server, `vllm serve`).

A server runs in its own process group, so stopping it reaches every worker it forked, with its output
appended to a log file. Whoever shares it finds it through a JSON state file that records its `pid` and
`start_ticks` (the process's start time: a recycled pid is never mistaken for it). `terminate` sends SIGTERM
to the group, then SIGKILL to what outlives a grace period. A server used by several jobs at once may have a
watchdog (`start_watchdog`): a detached process that stops it once no job has held its clients lock (a
shared flock per job, `ServerFiles.clients`) for a while.

`python -m eagle3build.engine.process watch LOCK STATE CLIENTS IDLE_S` is that watchdog.

What a workflow starts ends with it: the workflow records itself in the environment of its jobs
(`WORKFLOW_ENV`, set by rules/common.smk), a job process ends when its workflow does (`bind_to_workflow`),
and a server that outlives the job that started it (it serves the run's other jobs) watches the workflow
that owns it (`watch_owner`). A server that serves only the process that started it (an evaluation's
`vllm serve`) is `bound` to it: the kernel sends it SIGTERM when that process ends, even by SIGKILL
(`python -m eagle3build.engine.process exec-bound -- CMD` runs it so).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_children: dict[int, subprocess.Popen] = {}  # processes this process started, reaped on stop


# ---------------------------------------------------------------- liveness
def start_ticks(pid: int) -> int | None:
    """Start time of a live (non-zombie) process in clock ticks, None if it is gone (0 without procfs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no procfs: fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int | None, ticks: int | None = None) -> bool:
    """The process runs and, when `ticks` is known, is the one that started at that time."""
    if not pid:
        return False
    now = start_ticks(pid)
    return now is not None and (ticks in (None, 0) or now == ticks)


# ---------------------------------------------------------------- the workflow that owns a process
WORKFLOW_ENV = "EAGLE3BUILD_WORKFLOW"  # pid:start_ticks:host:pid namespace of the Snakemake process


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def workflow_marker(pid: int | None = None) -> str:
    """The value of WORKFLOW_ENV that names process `pid` (default: this one) as the jobs' workflow."""
    pid = pid or os.getpid()
    return f"{pid}:{start_ticks(pid) or 0}:{socket.gethostname()}:{_pid_namespace()}"


def workflow_owner(default_pid: int | None = None) -> dict | None:
    """The workflow this process belongs to, as {"pid", "start_ticks"}: the one WORKFLOW_ENV names when it
    runs on this host and in this pid namespace (elsewhere, e.g. a cluster node, its pid means nothing
    here); else `default_pid`'s process, or None."""
    pid, _, rest = os.environ.get(WORKFLOW_ENV, "").partition(":")
    ticks, _, rest = rest.partition(":")
    host, _, namespace = rest.partition(":")
    if pid.isdigit() and ticks.isdigit() and host == socket.gethostname() and namespace == _pid_namespace():
        return {"pid": int(pid), "start_ticks": int(ticks)}
    if default_pid:
        return {"pid": default_pid, "start_ticks": start_ticks(default_pid)}
    return None


def watch_owner(owner: dict, on_gone: Callable[[], None], poll_s: float = 1.0) -> threading.Thread:
    """A daemon thread that calls `on_gone()` once the owner process ({"pid", "start_ticks"}) has ended."""

    def run():
        while alive(owner["pid"], owner.get("start_ticks")):
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=run, name="owner-watch", daemon=True)
    thread.start()
    return thread


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end this process through SystemExit, so `finally` blocks and context managers
    run: atomic writers remove their temp files, held locks are released."""

    def handler(signum, frame):
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent ends (Linux PR_SET_PDEATHSIG).
    False where unsupported, or when the parent already ended."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    return os.getppid() == parent  # the parent may have ended before the call


def bind_to_workflow(grace_s: float = 30.0) -> None:
    """Make this job process end with its workflow: SIGTERM (then SystemExit, see exit_on_signals) when
    its parent ends or the workflow WORKFLOW_ENV names does, SIGKILL if it still runs grace_s later."""
    exit_on_signals()
    die_with_parent()
    owner = workflow_owner()
    if owner is not None and owner["pid"] != os.getpid():
        watch_owner(owner, lambda: end_self(f"workflow process {owner['pid']} ended", grace_s))


def end_self(reason: str, grace_s: float) -> None:
    """SIGTERM this process (its main thread unwinds through SystemExit); SIGKILL it after grace_s."""
    print(f"=== eagle3build: {reason}: stopping (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(128 + signal.SIGTERM)


# ---------------------------------------------------------------- start, wait, stop
def start(cmd: list[str], log_path: Path, env: dict | None = None,
          banner: str | None = None, bound: bool = False) -> subprocess.Popen:
    """Run cmd in its own process group (stopping it reaches every worker), its output appended to log_path.
    An OSError (no such program) reaches the caller.

    `bound`: the server belongs to the process that starts it (an evaluation's engine, a benchmark's), so
    it gets SIGTERM when that process ends, even by SIGKILL, where its own `finally` cannot stop it. The
    server's own group would otherwise outlive it and keep its GPUs' memory. A server shared by several
    jobs is not bound: its watchdog and owner stop it (start_watchdog)."""
    if bound:
        if shutil.which(cmd[0]) is None:
            raise FileNotFoundError(errno.ENOENT, "no such program", cmd[0])
        # exec'd by a small wrapper that asks the kernel for the signal first: a preexec_fn would run
        # Python between fork and exec, which is unsafe in a process with threads (a job's owner watch)
        cmd = module_command("eagle3build.engine.process", ["exec-bound", "--", *cmd])
    with open(log_path, "ab") as log:
        if banner:
            log.write(banner.encode())
            log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    _children[proc.pid] = proc
    return proc


class NotReady(Exception):
    """A server that exited (`returncode`) or was not ready in time (`returncode` None); it was stopped."""

    def __init__(self, returncode: int | None):
        super().__init__("not ready in time" if returncode is None else f"exited with status {returncode}")
        self.returncode = returncode


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, poll_s: float) -> None:
    """Poll `ready()` until it is true; raise NotReady (after stopping the server's group) if the server
    exits first or timeout_s passes."""
    ticks = start_ticks(proc.pid)
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            returncode = proc.poll()
            terminate(proc.pid, ticks, grace_s=10)
            raise NotReady(returncode)
        time.sleep(poll_s)


def terminate(pid: int, ticks: int | None, grace_s: float = 30.0) -> None:
    """SIGTERM the process group led by pid, then SIGKILL it if its leader outlives grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not alive(pid, ticks):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            child = _children.get(pid)
            if child is not None:
                child.poll()  # reap our own child so it does not linger as a zombie
            if not alive(pid, ticks):
                break
            time.sleep(0.05)
    child = _children.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1)


def log_tail(path: Path, start: int = 0, lines: int = 30) -> str:
    """The last lines of a log from byte `start` on (what a server wrote since it was started)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


# ---------------------------------------------------------------- state files and locks
def read_state(path: Path) -> dict | None:
    """A server's recorded state, None when there is none (or it is half written)."""
    try:
        state = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and "pid" in state else None


def stop_recorded(state_path: Path, grace_s: float = 30.0) -> bool:
    """Stop the server a state file records (and its watchdog), then drop the file. True if it was running."""
    state = read_state(state_path)
    if state is None:
        return False
    running = alive(state["pid"], state.get("start_ticks"))
    terminate(state["pid"], state.get("start_ticks"), grace_s)
    watchdog = state.get("watchdog_pid")
    if watchdog and watchdog != os.getpid():
        terminate(watchdog, None, grace_s=5)
    Path(state_path).unlink(missing_ok=True)
    return running


@contextlib.contextmanager
def flock(path: Path, mode: int) -> Iterator[int]:
    """Hold flock `mode` (LOCK_EX, LOCK_SH) on path; the kernel releases it if the holder dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def try_lock(path: Path) -> int | None:
    """An exclusive flock on path without waiting: its fd (close it to release), or None if held elsewhere."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unlocked(path: Path) -> bool:
    """True when nobody holds a lock on path (nobody uses the server whose clients lock it is)."""
    fd = try_lock(path)
    if fd is None:
        return False
    os.close(fd)
    return True


# ---------------------------------------------------------------- a server shared by several jobs
@dataclass
class ServerFiles:
    """A shared server's files: `lock` (held while starting, reusing or stopping it), `state` (its pid, start
    ticks, watchdog pid...), `clients` (a shared flock per job using it) and `log`."""

    lock: Path
    state: Path
    clients: Path
    log: Path

    @contextlib.contextmanager
    def client(self) -> Iterator[None]:
        """Hold a shared flock on the clients file while using the server (taken under `lock`)."""
        with flock(self.clients, fcntl.LOCK_SH):
            yield


def module_command(module: str, args: list[str]) -> list[str]:
    """The argv that runs `module`'s main() with this Python and this very checkout of the package, its
    environment untouched. Not `python -m`: that puts the working directory first on sys.path, so another
    checkout of the package there would run instead."""
    package_root = str(Path(__file__).resolve().parents[2])
    bootstrap = f"import sys; sys.path.insert(0, {package_root!r}); from {module} import main; sys.exit(main())"
    return [sys.executable, "-c", bootstrap, *args]


def start_watchdog(files: ServerFiles, idle_s: float) -> int:
    """A detached process that stops the server of `files` once unused for idle_s; returns its pid."""
    cmd = module_command("eagle3build.engine.process",
                         ["watch", str(files.lock), str(files.state), str(files.clients), str(float(idle_s))])
    return start(cmd, files.log, dict(os.environ)).pid


def watch(files: ServerFiles, idle_s: float) -> None:
    """Watchdog loop: stop the server once no job has held the clients lock for idle_s, or at once when no
    job holds it and the workflow its state names as `owner` ({"pid", "start_ticks"}) has ended."""
    poll_s = max(0.2, min(10.0, idle_s / 4))
    last_busy = time.monotonic()
    while True:
        time.sleep(poll_s)
        with flock(files.lock, fcntl.LOCK_EX):
            state = read_state(files.state)
            # Not (or no longer) our server: a newer watchdog is in charge, or it was stopped.
            ours = state is not None and state.get("watchdog_pid") == os.getpid()
            if not ours or not alive(state["pid"], state.get("start_ticks")):
                return
            owner = state.get("owner")
            orphaned = bool(owner) and not alive(owner["pid"], owner.get("start_ticks"))
            if not unlocked(files.clients):
                last_busy = time.monotonic()
            elif orphaned or time.monotonic() - last_busy >= idle_s:
                why = f"its workflow (pid {owner['pid']}) ended" if orphaned else f"idle for {idle_s:.0f} s"
                print(f"=== eagle3build watchdog: {why}, stopping pid {state['pid']}", flush=True)
                terminate(state["pid"], state.get("start_ticks"))
                files.state.unlink(missing_ok=True)
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3build.engine.process",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    watch_cmd = sub.add_parser("watch", help="the idle watchdog of a shared server (see start_watchdog)")
    for name in ("lock", "state", "clients"):
        watch_cmd.add_argument(name, type=Path)
    watch_cmd.add_argument("idle_s", type=float)
    bound_cmd = sub.add_parser("exec-bound", help="run CMD so that it gets SIGTERM when its starter ends "
                                                  "(start(..., bound=True))")
    bound_cmd.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "exec-bound":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        starter = os.getppid()
        die_with_parent()  # where the kernel cannot, the server runs unbound, as before
        if os.getppid() != starter:
            return 128 + signal.SIGTERM  # the starter ended before the signal was set: nobody would stop it
        os.execvp(cmd[0], cmd)  # the signal setting survives exec; the pid stays the group's leader
    watch(ServerFiles(args.lock, args.state, args.clients, Path(os.devnull)), args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
