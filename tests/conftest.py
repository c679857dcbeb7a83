import atexit
import os
import shutil
import tempfile

# The runs the tests start, in this process and in subprocesses, train with one thread rather than timing
# thread counts first (training/sizing.py); the tests of that choice unset it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiled code (runtime/compiled.py) is kept in a folder of the suite's own, removed at its end.
os.environ["KVGPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvgpt-tests-")
atexit.register(shutil.rmtree, os.environ["KVGPT_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    """Unless the cuda tests are asked for, the GPU is hidden: the suite proves the CPU path alike on any machine."""
    if "cuda" not in config.option.markexpr.replace("not cuda", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The tests' tensors are tiny: one thread is faster for them, and never stalls on a busy second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
