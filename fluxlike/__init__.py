"""fluxlike: a Flux-style neural-network library on MLX with scoped mixed precision.

This file is the public API manifest: explicit re-exports, nothing else.
"""

from ._blas import BlasInfo, BlasWarning, blas_info  # first: it puts an optimised BLAS under MLX
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
from . import losses  # noqa: F401  (fluxlike.losses.*)
from .layers.base import Layer
from .layers.basic import (
    Bilinear,
    Chain,
    Dense,
    Embedding,
    Parallel,
    Scale,
    SkipConnection,
    flatten,
)
from .layers.recurrent import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNCell
from .layers.conv import Conv, ConvTranspose
from .layers.pooling import AdaptiveMeanPool, GlobalMaxPool, GlobalMeanPool, MaxPool, MeanPool
from .layers.attention import MultiHeadAttention
from .layers.normalise import BatchNorm, Dropout, GroupNorm, InstanceNorm, LayerNorm, RMSNorm
from .modes import testmode, trainmode
from .precision.policy import autocast_policy, keep_float32, policy_of
from .precision.scope import autocast
from .precision import stock as _stock  # noqa: F401  (registers mlx.nn's layers)
from .precision.compiled import compile
from .precision.castcache import clear_cast_cache
from .precision.convert import bf16, bf16mix, f16, f16mix, f32, f64
from .data import DataLoader, onecold, onehot, onehotbatch
from .checkpoint import loadcheckpoint, loadmodel, savemodel, state
from .optimise import (
    Adam,
    AdamW,
    ClipNorm,
    ClipValue,
    Descent,
    Lion,
    Momentum,
    Nesterov,
    OptimiserChain,
    RMSProp,
    WeightDecay,
)
from .precision.lossscale import DynamicLossScale, StaticLossScale, all_finite
from .gradients import gradient, withgradient
from .optstate import OptState, setup, update
from .distributed import DataParallel, barrier
from .training import train
