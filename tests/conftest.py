import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import helpers.py
torch.set_num_threads(int(os.environ.get("SPECULATIVE_TEST_THREADS", min(2, torch.get_num_threads()))))


def pytest_terminal_summary(terminalreporter, config):
    """The quick run (`make test`, -m "not slow") says what it left out and how to run it."""
    if "not slow" in (config.option.markexpr or ""):
        left = len(terminalreporter.stats.get("deselected", []))
        terminalreporter.write_line(f"{left} slow tests left out (long statistical and end-to-end tests); "
                                    "`make test-all` runs every test")
