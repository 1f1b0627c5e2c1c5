"""Passing processes' output on as it comes: each line prefixed with its process (`[i] `),
progress bars that redraw with `\\r` passed on at every redraw, and the lines of Gloo (JAX's
CPU collectives) that only say a communicator reached all its peers left out.

`Terminal` is one output stream shared by several sources; `pump` copies one source into it.
`filter_own_stdout` runs the same filter on this process's own stdout (file descriptor 1,
where Gloo's C++ writes), for a multi-process run started without the launcher.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

__all__ = ["Screen", "Terminal", "filter_own_stdout", "keep_line", "pump"]

# Gloo prints a line per rank for every communicator it sets up (dozens per run); one that
# reached all its peers says nothing a user can act on. A shortfall is still shown (Gloo then
# adds an "is NOT connected to" line). Ranks print from several threads at once, each
# statement piece by piece ("[Gloo] Rank ", the rank, " is connected to ", the count, " peer
# ranks. Expected ... is : ", the count), so another thread's pieces can land between any two:
# a line is Gloo's when it holds one of its words and nothing but its words, numbers and spaces.
_GLOO_CONNECTED = re.compile(rb"is connected to (\d+) peer ranks\. Expected number of "
                             rb"connected peer ranks is : (\d+)")
_GLOO_WORDS = (b"[Gloo] Rank", b"is connected to", b"peer ranks.",
               b"Expected number of connected peer ranks is :")
_GLOO_PIECES = re.compile(b"|".join(re.escape(w) for w in _GLOO_WORDS) + rb"|\d+|\s+")
# a line may begin with any piece, a number (a rank's or a count's) included
_NUMBER = re.compile(rb"\s*\d*\s*")
_ENDS = re.compile(rb"[\r\n]")


def _may_become_gloos(start: bytes) -> bool:
  """Whether a line beginning `start` may still turn out to be one of Gloo's."""
  bare = start[_NUMBER.match(start).end():]
  return any(bare.startswith(w) or w.startswith(bare) for w in _GLOO_WORDS)


def keep_line(line: bytes) -> bool:
  """False for Gloo's "connected to all N peers" lines, whole or in interleaved pieces."""
  if any(m.group(1) != m.group(2) for m in _GLOO_CONNECTED.finditer(line)):
    return True
  return not any(w in line for w in _GLOO_WORDS) or bool(_GLOO_PIECES.sub(b"", line))


class Screen:
  """What several output streams share when they end up on one screen (a terminal shows a
  process's stdout and stderr together): whose line is unfinished, and on which stream."""

  def __init__(self):
    self.lock = threading.Lock()
    self.open: tuple[object, object] | None = None   # (source, out) of the unfinished line
    self.ended_for: set = set()     # sources whose unfinished line another source ended


class Terminal:
  """One output stream written by several sources. A source's unfinished line (a progress bar
  between redraws) is ended before another source writes, on this stream or another of the
  same `screen`, so lines never run into each other; each line, and each redraw after a
  `\\r`, starts with its source's prefix."""

  def __init__(self, out, screen: Screen | None = None):
    self.out = out
    self.screen = screen or Screen()

  def write(self, source: object, prefix: bytes, text: bytes, at_start: bool) -> None:
    """`text` of `source`, ending in at most one `\\r` or `\\n`; `at_start`: it begins a line
    (or a redraw) of that source."""
    self.write_all(source, prefix, [(text, at_start)])

  def write_all(self, source: object, prefix: bytes, pieces: list[tuple[bytes, bool]]) -> None:
    """`write` of each (text, at_start) in turn, no other source writing between them: what
    arrived in one read (a redraw's `\\r` and its text) is not split by another source's line."""
    screen = self.screen
    with screen.lock:
      for text, at_start in pieces:
        if screen.open is not None and screen.open[0] is not source:
          _write(screen.open[1], b"\n")   # another source's line is unfinished: keep it, above
          screen.ended_for.add(screen.open[0])
          screen.open = None
        ended = source in screen.ended_for
        screen.ended_for.discard(source)
        if ended and text == b"\n" and not at_start:
          continue      # the newline that ends a line already ended for it: not an empty line
        mine = screen.open is not None
        if (at_start or not mine) and text != b"\r":
          self.out.write(prefix)
        _write(self.out, text)
        screen.open = None if text.endswith(b"\n") else (source, self.out)

  def finish(self, source: object) -> None:
    """`source` ended: its unfinished line (a last redraw without a newline) is ended."""
    with self.screen.lock:
      self.screen.ended_for.discard(source)
      if self.screen.open is not None and self.screen.open[0] is source:
        _write(self.screen.open[1], b"\n")
        self.screen.open = None


def _write(out, data: bytes) -> None:
  out.write(data)
  out.flush()


def pump(stream, prefix: bytes, out, terminal: Terminal | None = None) -> None:
  """Copies `stream` (a binary file) to `out` (or `terminal`) as it arrives, prefixing every
  line; a line that may be Gloo's is held until it is whole, then kept or left out."""
  terminal = terminal or Terminal(out)
  read = getattr(stream, "read1", stream.read)
  held = b""            # the start of a line not passed on yet (it may be Gloo's)
  at_start = True       # the next byte begins a line or a redraw
  after_cr = False
  while chunk := read(65536):
    pieces = _ENDS.split(held + chunk)
    ends = _ENDS.findall(held + chunk)
    held = b""
    out_pieces = []       # what this read passes on, written together
    for piece, end in zip(pieces, [*ends, b""]):
      whole = piece + end
      if whole == b"\n" and after_cr:   # "\r\n": the line ends where the redraw left it
        at_start = False
      if whole:
        after_cr = end == b"\r"
      if not end:   # the unfinished rest: pass it on unless it may become a Gloo line
        if piece and at_start and _may_become_gloos(piece):
          held = piece
        elif piece:
          out_pieces.append((piece, at_start))
          at_start = False
        continue
      if at_start and not keep_line(whole):
        continue
      if whole:
        out_pieces.append((whole, at_start))
      at_start = True
    terminal.write_all(stream, prefix, out_pieces)
  if held:
    terminal.write(stream, prefix, held, at_start)
  terminal.finish(stream)
  stream.close()


def filter_own_stdout() -> None:
  """Routes this process's stdout (fd 1, which C++ libraries write to directly) through
  `pump` without a prefix, so Gloo's connection lines are left out as the launcher leaves
  them out; the filter drains at exit. A no-op when stdout is not a file descriptor."""
  try:
    sys.stdout.flush()
    real = os.dup(1)
  except (OSError, ValueError):
    return
  read_fd, write_fd = os.pipe()
  os.dup2(write_fd, 1)
  os.close(write_fd)
  thread = threading.Thread(target=pump, args=(os.fdopen(read_fd, "rb"), b"",
                                               os.fdopen(real, "wb", buffering=0)),
                            daemon=True, name="stdout-filter")
  thread.start()

  def drain() -> None:
    sys.stdout.flush()
    os.dup2(real, 1)    # the pipe's last writer closes: the filter reads its end and stops
    thread.join(timeout=5)

  atexit.register(drain)
