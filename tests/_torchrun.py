"""A multi-rank site as a test starts it: a ``torchrun`` job on CPU in a session of its own, and
its end, which leaves no rank behind (torchrun's workers share its process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import IO, Any

INHERITED_BY_RANKS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Variables of an enclosing torchrun job that must not leak into the one a test starts."""


def torchrun(
    args: list[str], *, nproc: int = 2, stdout: int | IO[Any] = subprocess.PIPE,
    stderr: int | IO[Any] = subprocess.STDOUT, **env: str,
) -> subprocess.Popen[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N ARGS`` with one thread
    per rank and no restarts, in a new session (``kill_group`` ends it whole)."""
    environment = {k: v for k, v in os.environ.items() if k not in INHERITED_BY_RANKS}
    environment.update(OMP_NUM_THREADS="1", **env)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "--max-restarts=0", *args,
    ]
    return subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=environment,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the job's whole process group (an exited group is fine) and reap torchrun."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the job ended by itself: nothing left to kill
        pass
    proc.wait()


def finish(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The job's output once it ended (``"(timed out)"`` after ``timeout_s``: only a hang gets
    there); the group is killed either way."""
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        output = "(timed out)"
    finally:
        kill_group(proc)
    return output
