"""Crash isolation for the CLI: explain and parity run in a child process, so a crash is one line.

Compiled code can kill the process that runs it (a SIGSEGV, or glibc aborting on heap
corruption in generated code: SIGABRT), and with it the terminal session's output. `explain`
and `parity` run the user's model compiled, so the `nsa-compile` program forks at its start,
before anything is computed, and the child runs the command (`cli.main(args)`). The child
shares stdout; its stderr goes into a pipe and is passed on when it ends, unless a signal killed
it: then one line says which signal, where in Python it was (from faulthandler's dump: the
innermost frame of the user's code, else the innermost frame) and what to try, and the exit
status is EXIT_CRASHED (with --debug the child's stderr is passed on too). The child dies with
the parent (a `timeout` or kill of the program leaves nothing running).

Forking is free (no second `import torch`) and safe only where nothing ran yet: a child forked
after an OpenMP parallel region hangs in its first one (GNU libgomp), and CUDA cannot be used in a
child forked after CUDA was initialized. So only the program's entry point isolates (main()
without arguments: the console script, `python -m nsa_compile`), and only on Linux; main(args)
called from Python (tests, scripts) runs the command in its own process.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import signal
import sys
import threading
import warnings

import click
import torch

from .coverage import shown_path
from .workload import _is_library

__all__ = ["ISOLATED_COMMANDS", "EXIT_CRASHED", "command_of", "can_isolate", "run_isolated", "crash_line"]

ISOLATED_COMMANDS = {
    "explain": "explain compiles with aot_eager (no Inductor code): --pass NAME runs one pass at a time, and "
               "the model's own code can be run without nsa-compile",
    "parity": "try --compiler aot_eager (no Inductor-generated code), then --compiler eager",
}
EXIT_CRASHED = 4
EXIT_INTERRUPTED = 130
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>.+)$')
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_DRAIN_S = 5.0  # how long to wait, after the child ended, for stderr its own children still hold open


def command_of(args: list[str]) -> str | None:
    """The command named in the CLI's arguments (the first one that is not an option)."""
    return next((a for a in args if not a.startswith("-")), None)


def can_isolate(args: list[str]) -> bool:
    """Whether the program's entry point runs this command in a child (see the module docstring)."""
    return (command_of(args) in ISOLATED_COMMANDS and "--help" not in args and sys.platform.startswith("linux")
            and not torch.cuda.is_initialized())


def run_isolated(args: list[str], main) -> None:
    """Run `main(ARGS)` (the command line's entry point, given by cli.py so that this module does not
    import it) in a forked child and end the program with the exit status to give:
    the child's, EXIT_CRASHED where a signal killed it, EXIT_INTERRUPTED on Ctrl-C. This process
    computed nothing, so it ends without the interpreter's teardown (which costs about 1 s of CPU
    with torch loaded, and the child does it already)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    parent = os.getpid()
    with warnings.catch_warnings():  # Python >= 3.12 warns of fork in a process with threads (BLAS's)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        _die_with(parent)
        os.close(read_end)
        os.dup2(write_end, 2)
        os.close(write_end)
        faulthandler.enable()
        main(args)  # exits with the command's status, as the program would
        sys.exit(0)
    os.close(write_end)
    held: list[str] = []
    reader = threading.Thread(target=_hold, args=(os.fdopen(read_end, errors="replace"), held), daemon=True)
    reader.start()
    while True:
        try:
            status = os.waitpid(pid, 0)[1]
            break
        except KeyboardInterrupt:  # the child got the Ctrl-C too (one process group) and ends on its own
            continue
    reader.join(_DRAIN_S)
    code, stderr = os.waitstatus_to_exitcode(status), "".join(held)
    if code >= 0 or -code == signal.SIGINT:
        sys.stderr.write(stderr)
        if code < 0:
            click.echo("aborted", err=True)
        _exit(EXIT_INTERRUPTED if code < 0 else code)
    if "--debug" in args:
        sys.stderr.write(stderr)
    click.echo(crash_line(command_of(args), -code, stderr), err=True)
    _exit(EXIT_CRASHED)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with(parent: int) -> None:
    """Have the kernel kill this child when the parent dies (a `timeout` or a kill of the program
    must not leave the command running): prctl(PR_SET_PDEATHSIG, SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(EXIT_INTERRUPTED)


def _hold(source, held: list[str]) -> None:
    with source:
        held.extend(source)


def crash_line(command: str | None, signum: int, stderr: str) -> str:
    """One line for a child killed by signal `signum`, from what it printed (faulthandler's dump)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    text = f"error: {command} crashed: the process running it died of {name} (signal {signum})"
    where = _crash_frame(stderr)
    if where:
        text += f" in {where}"
    if signum == signal.SIGKILL:
        return text + "; the system's out-of-memory killer ends processes this way: a smaller --batch or --seq-len"
    return f"{text}; {ISOLATED_COMMANDS.get(command, 'try --compiler aot_eager')} (--debug shows its output)"


def _crash_frame(stderr: str) -> str | None:
    """'file:line (function)' of the crashing thread's innermost Python frame in the user's code
    (else its innermost frame), from faulthandler's dump."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    frames = []
    for line in lines[start + 1:] if start is not None else []:
        frame = _FRAME.match(line)
        if frame is None:
            break
        frames.append(frame)
    if not frames:
        return None
    frame = next((f for f in frames if not _is_library(f["file"])), frames[0])
    return f"{shown_path(frame['file'])}:{frame['line']} ({frame['fn'].strip()})"

