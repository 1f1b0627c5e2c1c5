"""What every command line of the package shares: usage errors in one line, exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["ArgumentParser", "fail"]


def fail(message: str) -> int:
  """Prints `error: message` (one line, to stderr); returns the exit code of bad input, 2."""
  print(f"error: {message}", file=sys.stderr)
  return 2


class ArgumentParser(argparse.ArgumentParser):
  """argparse, but a usage error is one line naming the flag, with a pointer to `--help`,
  instead of the usage block followed by the error."""

  def error(self, message: str) -> NoReturn:
    fail(f"{message}; see {self.prog} --help.")
    sys.exit(2)
