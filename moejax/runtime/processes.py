"""Start P processes of one command on this machine, connected over loopback.

  python -m moejax.launch --processes 2 --devices_per_process 4 -- python train.py [flags]

Each child gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=P and
JAX_PROCESS_ID=i (read by `moejax.runtime.distributed`), JAX_PLATFORMS=cpu unless set, and with
--devices_per_process an XLA_FLAGS that fakes that many CPU devices. Output is passed on as it
comes (`moejax.runtime.streams`): each line prefixed with `[i] `, a progress bar at every
redraw, Gloo's "connected to all peers" lines left out. The first SIGTERM/SIGINT is forwarded
to every child (they finish the step, save and exit 0); a second one kills them. If a child
fails, the others are killed, one `error:` line names the child, its pid and its exit code or
signal, and the launcher exits with that child's code (128 + signal for a signal).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from moejax.runtime.streams import Screen, Terminal, pump


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict, index: int, processes: int, port: int,
              devices_per_process: int | None) -> dict:
  env = dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
             JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(index))
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("PYTHONUNBUFFERED", "1")   # a Python child's prints pass through as they come
  if devices_per_process is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
  return env


def exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def describe_failure(index: int, processes: int, pid: int, returncode: int,
                     by_launcher: bool = False) -> str:
  """The line naming a failed child: which one, and its exit code or the signal that ended it."""
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = f"signal {-returncode}"
    how = f"was killed by {name}" + (" (the launcher's, after a second signal)"
                                     if by_launcher else "")
  else:
    how = f"exited with code {returncode}"
  others = "; the launcher stopped the others" if processes > 1 else ""
  return (f"process {index} of {processes} (pid {pid}) {how}{others} and exits with "
          f"{exit_code(returncode)}.")


def launch(command: list[str], processes: int, devices_per_process: int | None = None,
           env: dict | None = None) -> int:
  """Runs `command` as processes 0..P-1; returns 0 iff all exit 0."""
  port = free_port()
  base = dict(os.environ if env is None else env)
  procs, pumps = [], []
  screen = Screen()   # a terminal shows stdout and stderr together
  terminals = (Terminal(sys.stdout.buffer, screen), Terminal(sys.stderr.buffer, screen))
  for i in range(processes):
    # A new session each: a terminal's Ctrl-C reaches only the launcher, which forwards once.
    p = subprocess.Popen(command, env=child_env(base, i, processes, port, devices_per_process),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         bufsize=0)
    procs.append(p)
    for stream, terminal in zip((p.stdout, p.stderr), terminals):
      t = threading.Thread(target=pump, args=(stream, f"[{i}] ".encode(), None, terminal),
                           daemon=True)
      t.start()
      pumps.append(t)
  signals_seen = []

  def forward(signum, frame):
    signals_seen.append(signum)
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum if len(signals_seen) == 1 else signal.SIGKILL)

  old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  failed: list[int] = []    # indices of failed children, in the order they were seen
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed or all(c == 0 for c in codes):
        break
      time.sleep(0.05)
    if failed:
      for p in procs:
        if p.poll() is None:
          p.kill()
    for p in procs:
      p.wait()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for s, h in old.items():
      signal.signal(s, h)
    for t in pumps:
      t.join(timeout=5)
  if not failed:
    return 0
  first = procs[failed[0]]
  by_launcher = len(signals_seen) > 1 and first.returncode == -signal.SIGKILL
  print("error: " + describe_failure(failed[0], processes, first.pid, first.returncode,
                                     by_launcher), file=sys.stderr, flush=True)
  return exit_code(first.returncode)
