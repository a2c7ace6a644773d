import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import helpers.py
torch.set_num_threads(int(os.environ.get("SPECULATIVE_TEST_THREADS", min(2, torch.get_num_threads()))))
