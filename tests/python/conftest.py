import pytest
import torch

import tempo  # noqa: F401  (loads the op library)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
