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


def test_another_processs_line_never_runs_into_an_unfinished_redraw():
  out = io.BytesIO()
  terminal = Terminal(out)
  bar, warning = object(), object()
  terminal.write(bar, b"[0] ", b"\r", True)
  terminal.write(bar, b"[0] ", b" 10%|#", True)
  terminal.write(warning, b"[1] ", b"warning: x\n", True)
  terminal.write(bar, b"[0] ", b"\r", True)
  terminal.write(bar, b"[0] ", b" 20%|##", True)
  terminal.finish(bar)
  assert out.getvalue() == b"\r[0]  10%|#\n[1] warning: x\n\r[0]  20%|##\n"


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
