"""Run every Triton kernel in these tests under the interpreter, on CPU tensors, unless told otherwise.

``@triton.jit`` (triton's own ``tl.sum`` etc. included) decides at decoration time whether a function is
interpreted, so the variable must be set before anything imports triton; conftest.py is imported first, and no
test file changes the variable or reloads a kernel module afterwards. Only the Triton tests use it: the API still
picks the torch backend for CPU tensors when backend is None. A value set outside wins:
``TRITON_INTERPRET=0 pytest tests/test_acting.py tests/test_triton.py`` runs the compiled kernels on a GPU (and
tests/test_triton.py skips, with its reason, on a host without one).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' tensors are tiny: a second intra-op thread only adds synchronisation (about 3x slower on a 2-core
# machine, worse on a busy one). Set before torch starts; the training processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def restore_tf32():
    """train() sets the process-wide TF32 switches (--fast turns them on): put them back for the other tests."""
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before[:2]
    torch.set_float32_matmul_precision(before[2])


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts Ray clusters or RL Zoo trainings (minutes; CI runs them)")
