"""Pre-fork worker processes for `sleuth serve-retriever --workers N` (as gunicorn's `--preload`).

The parent process loads the retriever once, binds the listening socket and forks N workers; each
worker builds the ASGI app around the retriever it inherited and serves the shared socket with
uvicorn (the kernel hands each new connection to one of the accepting workers). What the parent
loaded is then shared copy-on-write: the index's in-heap parts (faiss cannot memory-map a fast-scan
IVF-PQ index, so it reads its codes into the heap), the query encoder's weights and the imported
libraries. N workers cost about one copy plus what each allocates itself (its app, request buffers,
activations, the pages of Python objects it writes to), where spawned workers each load their own.

Fork safety. Threads do not survive `fork`: a thread pool the parent ran (faiss's and torch's
OpenMP pools, started by the first search) is left in the child as state without its threads, which
can hang the child's first parallel region. So the parent only loads and never searches; every
worker sets its thread counts and runs its warm-up search after the fork. (Idle pools that imports
create, such as OpenBLAS's, torch's pthreadpool and jemalloc's, re-create their threads after a fork.)

The parent is a supervisor: it forwards SIGINT/SIGTERM to the workers, reaps them, forks a new
worker for one that dies unexpectedly (the loaded retriever is still in the parent), and returns
once all have exited. Workers die with the parent (Linux: `PR_SET_PDEATHSIG`; elsewhere they
watch a pipe only the parent holds open).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A worker that could not build its app (e.g. the warm-up search failed) exits with this code; if
# no worker ever became ready the supervisor stops and exits with EXIT_STARTUP_FAILED, as loading
# errors do in one process.
WORKER_STARTUP_FAILED = 3
EXIT_STARTUP_FAILED = 2
# A worker that dies sooner than this after its fork counts as a quick failure: its replacement is
# delayed 0.5, 1, 2 ... (at most 30) seconds so a worker that always crashes does not spin the CPU.
QUICK_DEATH_S = 10.0
MAX_RESTART_DELAY_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def prefork_available() -> bool:
    """Whether pre-fork workers are the default here: Linux. (macOS has `os.fork`, but forking a
    process that loaded torch / Accelerate / Objective-C libraries is unsafe there; Python's own
    multiprocessing spawns by default on macOS for that reason.)"""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; as uvicorn binds (SO_REUSEADDR, IPv6
    when the host has a colon). Call `.listen()` once workers are about to accept: until then a
    client's connection is refused, as it is while a one-process server loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from err
    return sock


def preimport_serving_modules(*modules: str) -> None:
    """Import `modules` and what uvicorn imports when it starts serving, in the parent: their code
    objects and module state are then shared by all workers rather than rebuilt in each (and a
    worker starts faster). Modules that are not installed (optional uvicorn extras) are skipped."""
    import importlib

    # What uvicorn.Config's "auto" choices import (the protocol modules pick what is installed).
    uvicorn_parts = (
        "uvicorn",
        "uvicorn.server",
        "uvicorn.lifespan.on",
        "uvicorn.loops.auto",
        "uvicorn.loops.uvloop",
        "uvicorn.protocols.http.auto",
        "uvicorn.protocols.websockets.auto",
    )
    for name in (*uvicorn_parts, *modules):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def serve_socket(app: Any, sock: socket.socket) -> None:
    """Serve `app` with uvicorn on an already listening socket until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


@dataclass
class _Worker:
    slot: int
    pid: int
    started: float
    ready: bool = False


@dataclass
class Supervisor:
    """Forks `workers` processes that each call `build_app()` and serve the result on `sock`.

    `build_app` runs in the worker after the fork (set thread counts, build the app, warm up); it
    must not have been called, nor any search run, in the parent. `log` gets one line per event.
    """

    sock: socket.socket
    workers: int
    build_app: Callable[[], Any]
    serve: Callable[[Any, socket.socket], None] = serve_socket
    graceful_s: float = 30.0
    backlog: int = 2048
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))

    def __post_init__(self) -> None:
        self._parent = os.getpid()
        self._children: dict[int, _Worker] = {}
        self._due: dict[int, float] = {}  # slot -> when to fork its replacement
        self._quick_deaths: dict[int, int] = {}
        self._any_ready = False
        self._stopping = False
        self._deadline = 0.0
        self._exit_code = 0
        self._fds: dict[str, int] = {}

    # ------------------------------------------------------------------ parent

    def run(self) -> int:
        """Fork the workers and supervise them until a stop signal (0) or a startup failure (2)."""
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        wake_r, wake_w = os.pipe()
        ready_r, ready_w = os.pipe()
        death_r, death_w = os.pipe()  # workers watch death_r where prctl is unavailable
        for fd in (wake_r, wake_w, ready_r):
            os.set_blocking(fd, False)
        self._fds = {
            "wake_r": wake_r,
            "wake_w": wake_w,
            "ready_r": ready_r,
            "ready_w": ready_w,
            "death_r": death_r,
            "death_w": death_w,
        }
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
        old_wakeup = signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so SIGCHLD writes to wake_w
        try:
            self.sock.listen(self.backlog)
            # Objects the parent made now sit in the permanent generation: the workers' collections
            # leave them alone instead of writing to (and so copying) every page that holds one.
            gc.collect()
            gc.freeze()
            for slot in range(self.workers):
                self._fork(slot)
            self._loop()
        finally:
            self._kill_all(signal.SIGKILL)
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        return self._exit_code

    def _loop(self) -> None:
        wake_r, ready_r = self._fds["wake_r"], self._fds["ready_r"]
        while True:
            self._reap()
            now = time.monotonic()
            if self._stopping:
                if now >= self._deadline:
                    self.log(
                        f"workers still running {self.graceful_s:g} s after the stop signal: killing them"
                    )
                    self._kill_all(signal.SIGKILL)
                    self._deadline = float("inf")
            else:
                for slot, due in list(self._due.items()):
                    if due <= now:
                        del self._due[slot]
                        self._fork(slot)
            if not self._children and (self._stopping or not self._due):
                break
            waits = [t - now for t in self._due.values()] + ([self._deadline - now] if self._stopping else [])
            timeout = max(0.0, min([1.0, *waits]))
            with contextlib.suppress(InterruptedError):
                readable, _, _ = select.select([wake_r, ready_r], [], [], timeout)
                if wake_r in readable:
                    _drain(wake_r)
                if ready_r in readable:
                    self._read_ready(ready_r)

    def _fork(self, slot: int) -> None:
        for stream in (sys.stdout, sys.stderr):  # else buffered output would be written by both
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:
            self._child_main()  # never returns
        self._children[pid] = _Worker(slot, pid, time.monotonic())

    def _read_ready(self, fd: int) -> None:
        data = _drain(fd)
        for token in data.split():
            worker = self._children.get(int(token))
            if worker is not None:
                worker.ready = True
                self._any_ready = True

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self._children.pop(pid, None)
            if worker is None:
                continue
            self._read_ready(self._fds["ready_r"])  # a ready line it wrote just before dying
            code = os.waitstatus_to_exitcode(status)
            if self._stopping:
                continue
            how = f"exited with code {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
            if code == WORKER_STARTUP_FAILED and not self._any_ready:
                self.log(f"worker {pid} could not start (see above); stopping")
                self._exit_code = EXIT_STARTUP_FAILED
                self._begin_stop(signal.SIGTERM)
                continue
            lived = time.monotonic() - worker.started
            quick = self._quick_deaths.get(worker.slot, 0) + 1 if lived < QUICK_DEATH_S else 0
            self._quick_deaths[worker.slot] = quick
            delay = 0.0 if not quick else min(MAX_RESTART_DELAY_S, 0.5 * 2 ** (quick - 1))
            self.log(
                f"worker {pid} {how} after {lived:.1f} s; forking a new one"
                + (f" in {delay:g} s" if delay else "")
            )
            self._due[worker.slot] = time.monotonic() + delay

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        if self._stopping:  # a second Ctrl-C: do not wait for in-flight requests
            self._kill_all(signal.SIGKILL)
            return
        self._begin_stop(signum)

    def _begin_stop(self, signum: int) -> None:
        self._stopping = True
        self._due.clear()
        self._deadline = time.monotonic() + self.graceful_s
        # Forwarded as SIGTERM whichever came: a Ctrl-C in a terminal also sends SIGINT to the workers
        # (same process group), and uvicorn takes a second SIGINT as "exit now, drop requests".
        del signum
        self._kill_all(signal.SIGTERM)

    def _kill_all(self, sig: int) -> None:
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGKILL:  # after SIGKILL nothing can linger: reap now
            for pid in list(self._children):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                self._children.pop(pid, None)

    # ------------------------------------------------------------------ worker

    def _child_main(self) -> None:
        code = 1
        try:
            code = self._child_run()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            # os._exit: the parent's atexit handlers and finalizers are the parent's, not this worker's.
            os._exit(code)

    def _child_run(self) -> int:
        fds = self._fds
        signal.set_wakeup_fd(-1)
        for name in ("wake_r", "wake_w", "ready_r", "death_w"):
            os.close(fds[name])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # Until uvicorn installs its own handlers (and after it restores these and re-raises the
        # signal it shut down on), a stop signal ends the worker cleanly.
        signal.signal(signal.SIGINT, _exit_on_signal)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        _die_with_parent(self._parent, fds["death_r"])
        try:
            app = self.build_app()
        except Exception as err:  # reported here; the supervisor decides what follows
            print(
                f"error: worker {os.getpid()}: building the app or its warm-up search failed: "
                f"{type(err).__name__}: {err}",
                file=sys.stderr,
                flush=True,
            )
            return WORKER_STARTUP_FAILED
        os.write(fds["ready_w"], f"{os.getpid()}\n".encode())
        self.serve(app, self.sock)
        return 0


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def _drain(fd: int) -> bytes:
    chunks = []
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    return b"".join(chunks)


def _die_with_parent(parent: int, death_r: int) -> None:
    """SIGTERM this worker when the supervisor dies, however it dies (kill -9 included)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
                os.close(death_r)
                if os.getppid() != parent:  # the parent died before prctl took effect
                    os.kill(os.getpid(), signal.SIGTERM)
                return

    def watch() -> None:  # only the parent holds the write end: EOF means it is gone
        with contextlib.suppress(OSError):
            os.read(death_r, 1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="sleuth-parent-watch", daemon=True).start()


def run_supervisor(sock: socket.socket, workers: int, build_app: Callable[[], Any], **options: Any) -> int:
    """`Supervisor(sock, workers, build_app, **options).run()`: the exit code for the command."""
    return Supervisor(sock, workers, build_app, **options).run()
