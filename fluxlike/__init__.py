"""fluxlike: a Flux-style neural-network library on MLX with scoped mixed precision.

This file is the public API manifest: explicit re-exports, nothing else.
"""

from .activations import (
    elu,
    gelu,
    identity,
    leakyrelu,
    logsoftmax,
    logsumexp,
    relu,
    sigmoid,
    softmax,
    softplus,
    swish,
    tanh,
)
from .layers.base import Layer
from .layers.basic import Chain, Dense
from .modes import testmode, trainmode
from .precision.policy import autocast_policy, policy_of
from .precision.scope import autocast
from .precision import stock as _stock  # noqa: F401  (registers mlx.nn's layers)
from .precision.compiled import compile
