"""Loaded by a test's subprocess (tests/blocker on PYTHONPATH): the modules named in
SPECULATIVE_TEST_BLOCK cannot be imported, as if their packages were not installed."""

import os
import sys

BLOCKED = {name for name in os.environ.get("SPECULATIVE_TEST_BLOCK", "").split(",") if name}


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, Blocker())
