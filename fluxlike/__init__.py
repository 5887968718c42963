"""fluxlike: a Flux-style neural-network library on MLX with scoped mixed precision.

This file is the public API manifest: explicit re-exports, ``__all__`` and ``__version__``.

``from fluxlike import *`` brings in exactly ``__all__``: the layers, activations, training
functions, optimiser rules and precision tools, but not the submodules (``fluxlike.losses``
is imported as such) and not ``fluxlike.compile``, which would shadow Python's ``compile``.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

try:
    import mlx.core as _mlx_core  # noqa: F401
except ImportError as _error:  # MLX's Linux wheel alone has no backend (libmlx.so)
    if "libmlx" not in str(_error):
        raise
    raise ImportError(
        "fluxlike: MLX is installed without a backend (no libmlx.so). On Linux choose one with "
        "fluxlike's extras: pip install 'fluxlike[cpu]', 'fluxlike[cuda12]' or "
        "'fluxlike[cuda13]' (or mlx's own: pip install 'mlx[cpu]')"
    ) from _error

from ._blas import BlasInfo, BlasWarning, blas_info  # first: it puts an optimised BLAS under MLX
from .activations import (
    celu,
    elu,
    gelu,
    gelu_erf,
    gelu_tanh,
    hardsigmoid,
    hardswish,
    hardtanh,
    identity,
    leakyrelu,
    lisht,
    logcosh,
    logsoftmax,
    logsumexp,
    mish,
    relu,
    relu6,
    selu,
    sigmoid,
    softmax,
    softplus,
    softsign,
    swish,
    tanh,
    tanhshrink,
)
from . import losses  # noqa: F401  (fluxlike.losses.*)
from .init import (
    glorot_normal,
    glorot_uniform,
    identity_init,
    kaiming_normal,
    kaiming_uniform,
    ones32,
    orthogonal,
    sparse_init,
    truncated_normal,
    zeros32,
)
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
from .layers.embeddingbag import EmbeddingBag
from .layers.fusion import Maxout, PairwiseFusion
from .layers.recurrent import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNCell
from .layers.conv import Conv, ConvTranspose, CrossCor, DepthwiseConv
from .layers.upsample import PixelShuffle, Upsample
from .layers.pooling import AdaptiveMeanPool, GlobalMaxPool, GlobalMeanPool, MaxPool, MeanPool
from .layers.attention import MultiHeadAttention
from .layers.weightnorm import WeightNorm
from .layers.normalise import (
    AlphaDropout,
    BatchNorm,
    Dropout,
    GroupNorm,
    InstanceNorm,
    LayerNorm,
    RMSNorm,
)
from .modes import testmode, trainmode
from .utils import modules, outputsize
from .precision.policy import autocast_policy, keep_float32, policy_of
from .precision.scope import autocast
from .precision import stock as _stock  # noqa: F401  (registers mlx.nn's layers)
from .precision.compiled import compile
from .precision.castcache import clear_cast_cache
from .precision.convert import bf16, bf16mix, f16, f16mix, f32, f64
from .data import DataLoader, onecold, onehot, onehotbatch
from .checkpoint import loadcheckpoint, loadmodel, savemodel, state
from .optimisers.rules import (
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
from .optimisers.adaptive import (
    AdaBelief,
    AdaDelta,
    AdaGrad,
    AdaMax,
    AMSGrad,
    NAdam,
    OAdam,
    RAdam,
)
from .optimisers.signs import Rprop, SignDecay, Signum
from .optimisers.accumulate import AccumGrad
from .precision.lossscale import NoOpLossScale, StaticLossScale, all_finite
from .precision.dynamicscale import DynamicLossScale
from .gradients import gradient, withgradient
from .optimisers.state import OptState, setup, update
from .optimisers.hyperparameters import adjust
from .distributed import DataParallel, barrier
from .training import train, trainstep, trainstep_withgradient

try:
    __version__: str = _version("fluxlike")
except _PackageNotFoundError:  # a checkout on sys.path that was never pip-installed
    __version__ = "0.0.0+unknown"

# Public names, grouped as above. `compile` is public as `fluxlike.compile` but not star-exported.
__all__ = [
    # BLAS under MLX (Linux CPU)
    "BlasInfo", "BlasWarning", "blas_info",
    # activations
    "elu", "gelu", "identity", "leakyrelu", "logsoftmax", "logsumexp", "relu", "sigmoid",
    "softmax", "softplus", "swish", "tanh", "celu", "gelu_erf", "gelu_tanh", "hardsigmoid",
    "hardswish", "hardtanh", "lisht", "logcosh", "mish", "relu6", "selu", "softsign",
    "tanhshrink",
    # initialisers
    "glorot_normal", "glorot_uniform", "identity_init", "kaiming_normal", "kaiming_uniform",
    "ones32", "orthogonal", "sparse_init", "truncated_normal", "zeros32",
    # layers
    "Layer", "Bilinear", "Chain", "Dense", "Embedding", "Parallel", "Scale", "SkipConnection",
    "flatten", "GRU", "LSTM", "RNN", "GRUCell", "LSTMCell", "RNNCell", "Conv", "ConvTranspose",
    "CrossCor", "DepthwiseConv", "EmbeddingBag", "Maxout", "PairwiseFusion",
    "AdaptiveMeanPool", "GlobalMaxPool", "GlobalMeanPool", "MaxPool", "MeanPool",
    "PixelShuffle", "Upsample",
    "MultiHeadAttention", "BatchNorm", "Dropout", "GroupNorm", "InstanceNorm", "LayerNorm",
    "RMSNorm", "AlphaDropout", "WeightNorm", "testmode", "trainmode",
    # model utilities
    "modules", "outputsize",
    # precision
    "autocast", "autocast_policy", "policy_of", "clear_cast_cache", "bf16", "bf16mix", "f16",
    "f16mix", "f32", "f64", "keep_float32", "DynamicLossScale", "NoOpLossScale", "StaticLossScale",
    "all_finite",
    # data and checkpoints
    "DataLoader", "onecold", "onehot", "onehotbatch", "loadcheckpoint", "loadmodel", "savemodel",
    "state",
    # optimiser rules, gradients, training
    "Adam", "AdamW", "ClipNorm", "ClipValue", "Descent", "Lion", "Momentum", "Nesterov",
    "OptimiserChain", "RMSProp", "WeightDecay", "AdaBelief", "AdaDelta", "AdaGrad", "AdaMax",
    "AMSGrad", "NAdam", "OAdam", "RAdam", "Rprop", "SignDecay", "Signum", "AccumGrad", "adjust",
    "gradient", "withgradient", "OptState", "setup", "update", "train", "trainstep",
    "trainstep_withgradient",
    # several processes
    "DataParallel", "barrier",
]  # fmt: skip
