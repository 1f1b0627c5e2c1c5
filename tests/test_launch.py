"""`python -m moejax.launch` as a user watches it: each process's output arrives as it is
written, a progress bar at every redraw (`\\r`), lines of several processes never run into each
other; when a process fails, one line names it, its pid and its exit code or signal."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from moejax.runtime.streams import Terminal, pump
from tests.run_config import REPO_ROOT

GLOO = (b"[Gloo] Rank %d is connected to %d peer ranks. Expected number of connected peer "
        b"ranks is : %d\n")


def test_redraws_pass_on_with_their_prefix_and_gloos_lines_are_left_out_even_split():
  out = io.BytesIO()
  terminal = Terminal(out)
  chunks = [b"XLA_FLAGS=x\n\r  0%|", b"   | 0/3\r 33%|#  | 1/3", b"\r100%|###| 3/3\n[Gl",
            b"oo] Rank 0 is conn", (GLOO % (0, 1, 1))[21:], GLOO % (1, 0, 1), b"done\r\n"]

  class Chunks(io.RawIOBase):   # a pipe: what was written so far, a piece at a time
    def __init__(self):
      self.left = list(chunks)

    def read(self, n=-1):
      return self.left.pop(0) if self.left else b""

  pump(Chunks(), b"[0] ", None, terminal)
  assert out.getvalue() == (b"[0] XLA_FLAGS=x\n\r[0]   0%|   | 0/3\r[0]  33%|#  | 1/3"
                            b"\r[0] 100%|###| 3/3\n[0] " + GLOO % (1, 0, 1) + b"[0] done\r\n")


def test_gloos_lines_are_left_out_also_when_its_threads_interleave_them():
  """Ranks print from several threads: a line may hold two statements, or only the tail of
  one (both seen from two train.py processes on one host). A shortfall stays."""
  from moejax.runtime.streams import keep_line

  interleaved = (b"[Gloo] Rank 0 is connected to 3 peer ranks. [Gloo] Rank 1 is connected to 3 "
                 b"peer ranks. Expected number of connected peer ranks is : 3\n")
  # a rank's number cut from its statement by another rank's, whose tail is the next line
  cut = (b"[Gloo] Rank 1[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of "
         b"connected peer ranks is : 3\n")
  tail = b" is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
  # the same, the rank's number kept with its statement on the next line
  numbered = b"2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
  # one rank's statement cut after "is connected to", its count's tail on the next line
  # (seen from two train.py processes on a loaded CI host)
  halves = (b"[Gloo] Rank 1 is connected to [Gloo] Rank 2 is connected to 3 peer ranks. "
            b"Expected number of connected peer ranks is : 3\n",
            b"3 peer ranks. Expected number of connected peer ranks is : 3\n")
  for noise in (GLOO % (0, 7, 7), b"[Gloo] Rank " + GLOO % (1, 7, 7), interleaved,
                b"Expected number of connected peer ranks is : 3\n", cut, tail, numbered,
                b"[Gloo] Rank [Gloo] Rank \n", *halves, b"peer ranks. \n"):
    assert not keep_line(noise), noise
  for kept in (GLOO % (2, 6, 7), b"[Gloo] Rank 2 is NOT connected to: [1]\n", b"\n",
               b"2 is connected to 1 peer ranks. Expected number of connected peer ranks is : 3\n",
               b"3 steps\n", b"12\n", b"Rank 2 is connected to the coordinator\n",
               b"Expected number of steps: 3\n", b"steps 0..29: loss 5.6 -> 3.1\n"):
    assert keep_line(kept), kept
  # through the pump, arriving cut mid-statement: the pieces are held until their line ends
  text = b"".join(halves) + b"3 steps\n"
  pieces = [text[i:i + 7] for i in range(0, len(text), 7)]

  class Pieces(io.RawIOBase):
    def read(self, n=-1):
      return pieces.pop(0) if pieces else b""

  out = io.BytesIO()
  pump(Pieces(), b"", out)
  assert out.getvalue() == b"3 steps\n"


def _one_screen():
  """(stderr bytes, stdout bytes, their Terminals) sharing one screen."""
  from moejax.runtime.streams import Screen

  err, out = io.BytesIO(), io.BytesIO()
  screen = Screen()
  return err, out, Terminal(err, screen), Terminal(out, screen)


def test_another_processs_line_never_runs_into_an_unfinished_redraw():
  """Process 0's bar on stderr, process 1's line on stdout, one screen: the bar's line is
  ended (on stderr) before the other line is written."""
  err, out, stderr, stdout = _one_screen()
  bar, warning, line = object(), object(), object()
  stderr.write(bar, b"[0] ", b"\r", True)
  stderr.write(bar, b"[0] ", b" 10%|#", True)
  stderr.write(warning, b"[1] ", b"warning: x\n", True)
  stderr.write(bar, b"[0] ", b"\r", True)
  stderr.write(bar, b"[0] ", b" 20%|##", True)
  stdout.write(line, b"[1] ", b"steps\n", True)
  stderr.write(bar, b"[0] ", b"\r", True)
  stderr.write(bar, b"[0] ", b" 30%|###", True)
  stderr.finish(bar)
  assert err.getvalue() == (b"\r[0]  10%|#\n[1] warning: x\n\r[0]  20%|##\n"
                            b"\r[0]  30%|###\n")
  assert out.getvalue() == b"[1] steps\n"


def test_a_line_ended_for_its_source_gets_no_empty_line_after_it():
  """Process 0's stdout line arrives without its newline, process 0's stderr writes a line
  (which ends the stdout line), then the newline arrives: no empty prefixed line; text that
  goes on after such an end starts a prefixed line of its own."""
  err, out, stderr, stdout = _one_screen()
  so, se = object(), object()
  stdout.write(so, b"[0] ", b"done", True)
  stderr.write(se, b"[0] ", b" step 2/2\n", True)
  stdout.write(so, b"[0] ", b"\n", False)
  stdout.write(so, b"[0] ", b"next", True)
  stderr.write(se, b"[0] ", b"warn\n", True)
  stdout.write(so, b"[0] ", b" part\n", False)
  assert out.getvalue() == b"[0] done\n[0] next\n[0]  part\n"
  assert err.getvalue() == b"[0]  step 2/2\n[0] warn\n"


def _launcher(code: str, processes: int) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  return subprocess.Popen([sys.executable, "-m", "moejax.launch", "-n", str(processes), "--",
                           sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_progress_bar_arrives_while_the_process_runs(tmp_path):
  """The child redraws a bar with \\r (no newline) and waits: the launcher has passed the
  redraw on before the child goes on."""
  go = tmp_path / "go"
  code = ("import os, sys, time\n"
          "sys.stderr.write('\\r step 1/2'); sys.stderr.flush()\n"
          f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
          "sys.stderr.write('\\r step 2/2\\n'); print('done')\n")
  proc = _launcher(code, 1)
  seen = bytearray()

  def read():
    while chunk := proc.stderr.read1(4096):
      seen.extend(chunk)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    deadline = time.time() + 60
    while b"[0]  step 1/2" not in seen and time.time() < deadline:
      time.sleep(0.02)
    assert b"\r[0]  step 1/2" in seen, bytes(seen)
    assert proc.poll() is None          # the child still waits: this was passed on live
  finally:
    go.write_text("")
  assert proc.wait(timeout=60) == 0
  reader.join(timeout=10)
  assert bytes(seen).endswith(b"\r[0]  step 2/2\n"), bytes(seen)
  assert proc.stdout.read() == b"[0] done\n"


def test_a_failed_process_is_named_with_its_pid_and_its_signal_or_exit_code():
  code = ("import os, signal, time\n"
          "if os.environ['JAX_PROCESS_ID'] == '1':\n"
          "  print('pid', os.getpid(), flush=True); {}\n"
          "time.sleep(60)\n")
  for how, rc, said in (("os.kill(os.getpid(), signal.SIGKILL)", 137, "was killed by SIGKILL"),
                        ("exit(5)", 5, "exited with code 5")):
    proc = _launcher(code.format(how), 2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == rc, err
    pid = re.search(rb"\[1\] pid (\d+)", out).group(1).decode()
    last = err.decode().strip().splitlines()[-1]
    assert last == (f"error: process 1 of 2 (pid {pid}) {said}; the launcher stopped the "
                    f"others and exits with {rc}."), err
  proc = _launcher("import os; exit(int(os.environ['JAX_PROCESS_ID']) + 4)", 1)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 4
  assert re.fullmatch(r"error: process 0 of 1 \(pid \d+\) exited with code 4 and exits with "
                      r"4\.", err.decode().strip()), err


def test_processes_on_one_cpu_host_share_the_meshs_devices():
  """train.py's default fake devices: mesh.host_device_count for the whole job, so the plain
  JAX_* variables give the mesh the launcher gives (`-n 2 -d 4`: 2 x 4 = 8 devices)."""
  from moejax.runtime import xla_flags

  plain = dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:1234", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID="1")
  flag = "--xla_force_host_platform_device_count="
  assert xla_flags.default_xla_flags(plain, "cpu", 8) == flag + "4"
  assert xla_flags.default_xla_flags({}, "cpu", 8) == flag + "8"
  assert xla_flags.default_xla_flags(dict(plain, JAX_NUM_PROCESSES="3"), "cpu", 8) == flag + "8"
  assert xla_flags.default_xla_flags(dict(plain, MOEJAX_DISTRIBUTED="0"), "cpu", 8) == flag + "8"
  assert xla_flags.default_xla_flags(dict(plain, XLA_FLAGS=""), "cpu", 8) is None
  assert xla_flags.default_xla_flags(plain, "gpu", 1) == " ".join(xla_flags.GPU_FLAGS)


@pytest.mark.slow   # two train.py processes on loopback, a compile each: a minute on 2 cores
def test_the_plain_jax_variables_on_one_cpu_host_train_on_the_launchers_mesh(tmp_path):
  """JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID by hand, no launcher and no
  XLA_FLAGS: each process fakes half of mesh.host_device_count (the 2 x 4 x 1 mesh of
  `moejax.launch -n 2 -d 4`), prints no Gloo connection line, and process 0's last lines
  come through the stdout filter."""
  from moejax.runtime.processes import free_port
  from tests import run_helpers

  run_dir = tmp_path / "run"
  port = free_port()
  procs = []
  for i in range(2):
    env = {k: v for k, v in run_helpers.subprocess_env().items() if k != "XLA_FLAGS"}
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen(
        [*run_helpers.train_command(run_dir, num_steps=3), "--gin_bindings=mesh.data = -1"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  outs = [p.communicate(timeout=400)[0].decode() for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  for out in outs:
    assert out.startswith("XLA_FLAGS=--xla_force_host_platform_device_count=4 "), out[:300]
    assert "[Gloo]" not in out and "Expected number of connected" not in out, out
  assert re.search(r"^steps 0\.\.2: loss [\d.]+ -> [\d.]+; run dir ", outs[0], re.M), outs[0]
  with open(run_dir / "memory.txt") as f:
    assert f.readline().startswith("XLA compiled train step ep/2x4x1/")
