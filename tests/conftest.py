import sys
from pathlib import Path

import mlx.core as mx
import pytest

import fluxlike  # noqa: F401  (puts the optimised BLAS under MLX for every test)

sys.path.insert(0, str(Path(__file__).parent))  # for `import helpers`


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state."""
    mx.random.seed(0)
