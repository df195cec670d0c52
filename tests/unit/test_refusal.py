"""troupe's refusals by design read as one line when nothing catches them, under any launcher."""

from __future__ import annotations

import subprocess
import sys

RAISES = """
from troupe.util import Refusal, one_line_refusals
one_line_refusals()
one_line_refusals()  # idempotent: one hook, one line
raise Refusal({!r})
"""


def test_an_uncaught_refusal_is_one_line_and_other_errors_keep_their_traceback():
    said = subprocess.run([sys.executable, "-c", RAISES.format("rank 0: a tied parameter cannot be partitioned")],
                          capture_output=True, text=True, timeout=60)
    assert (said.returncode, said.stderr) == (1, "troupe: rank 0: a tied parameter cannot be partitioned\n")
    other = subprocess.run([sys.executable, "-c", RAISES.replace("raise Refusal", "raise KeyError").format("x")],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and "Traceback" in other.stderr and "KeyError: 'x'" in other.stderr
