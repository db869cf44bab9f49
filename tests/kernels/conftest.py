"""Run Triton kernels on CPU tensors: the interpreter must be chosen before triton is imported."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The interpreter evaluates masked-out lanes too (0/0 in rows that are never stored).
warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
