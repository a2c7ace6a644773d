import os

import pytest
import torch

# Torch threads of each test process: SPECULATIVE_TEST_THREADS, else this machine's (at most 2)
# shared among pytest-xdist's workers (`make test` runs two); the processes tests start get as many.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = int(os.environ.get("SPECULATIVE_TEST_THREADS", max(1, min(2, torch.get_num_threads()) // WORKERS)))
os.environ["SPECULATIVE_TEST_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)

# The compiled int8 kernel (models/int8_kernel.py) is built once into the user's cache, not
# into the temporary caches that tests point SPECULATIVE_CACHE at (a build takes ~15 s).
if not os.environ.get("SPECULATIVE_KERNEL_CACHE"):
    from speculative.models.presets import cache_root

    os.environ["SPECULATIVE_KERNEL_CACHE"] = str(cache_root() / "kernels")


def pytest_terminal_summary(terminalreporter, config):
    """The quick run (`make test`, -m "not slow") says what it left out and how to run it."""
    if "not slow" in (config.option.markexpr or ""):
        left = len(terminalreporter.stats.get("deselected", []))  # 0 under pytest-xdist: its workers deselect
        terminalreporter.write_line(f"{f'{left} ' if left else ''}slow tests left out (long statistical and "
                                    "end-to-end tests); `make test-all` runs every test")


@pytest.fixture(scope="module")
def ops():
    """The compiled kernels (models/csrc), or a skip where they cannot be built."""
    from speculative.models.int8_kernel import compiled_ops

    try:
        return compiled_ops(required=True)
    except RuntimeError as error:
        pytest.skip(str(error))
