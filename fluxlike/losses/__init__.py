"""Loss functions with Flux's names and semantics, in MLX's layout (class axis last).

Every loss is ``loss(ŷ, y, *, agg="mean", ...)``: ``ŷ`` (``yhat``) is the prediction and
``y`` the target, of the same shape (a shape mismatch is a ``ValueError``; for the elementwise
losses a Python number ``y`` is a constant target). ``agg`` reduces the elementwise loss (or,
for the class-axis losses, the per-sample loss): ``"mean"`` (default), ``"sum"``, ``"none"``
(return the array), or a function applied to that array.

The class-axis losses (``crossentropy``, ``logitcrossentropy``, ``kldivergence``,
``focal_loss``) sum over ``axis`` (default ``-1``) first, so ``agg="mean"`` is the mean over
samples of the per-sample sum over classes, as in Flux; ``agg="none"`` returns the
per-sample losses with the class axis removed. Their target ``y`` is either one-hot /
probabilities of ``ŷ``'s shape, or integer class indices (0-based) of ``ŷ``'s shape without
the class axis; a Python ``int`` is a class index, as ``mx.array(3)`` is, and a Python
``float`` is a ``TypeError`` (a constant probability target must be an array). Class indices
are range-checked (a ``ValueError``; this reads two numbers back to the host, one
synchronisation per call); inside ``mx.compile`` nothing can be read back and an
out-of-range index makes its sample's loss NaN instead.

The overlap losses (``dice_coeff_loss``, ``tversky_loss``) default to ``agg=None``, as in Flux:
one loss from sums over all entries; with an ``agg`` they compute one loss per sample (sums
over the axes after the batch axis) and reduce those.

Precision (policy "fp32", no scope read needed): half-precision inputs are cast up and the
loss is computed, accumulated and returned in float32, inside or outside
:func:`~fluxlike.autocast`. float32 and float64 inputs keep their dtype (float64 if either
input is float64). ``eps`` defaults to the machine epsilon of that compute dtype.

>>> import mlx.core as mx
>>> from fluxlike.losses import mse, logitcrossentropy
>>> mse(mx.array([1.0, 2.0]), mx.array([1.0, 4.0])).item()
2.0
>>> logitcrossentropy(mx.zeros((3, 4), dtype=mx.float16), mx.array([0, 1, 3])).dtype
mlx.core.float32
"""


from ._common import AGGREGATIONS
from .classification import (
    binary_focal_loss,
    binarycrossentropy,
    crossentropy,
    focal_loss,
    hinge_loss,
    kldivergence,
    logitbinarycrossentropy,
    logitcrossentropy,
    siamese_contrastive_loss,
    squared_hinge_loss,
)
from .regression import huber_loss, mae, mse, msle, poisson_loss
from .segmentation import dice_coeff_loss, tversky_loss
from .sequence import ctc_loss

__all__ = [
    "AGGREGATIONS", "binary_focal_loss", "binarycrossentropy", "crossentropy", "ctc_loss",
    "dice_coeff_loss", "focal_loss", "hinge_loss", "huber_loss", "kldivergence",
    "logitbinarycrossentropy", "logitcrossentropy", "mae", "mse", "msle", "poisson_loss",
    "siamese_contrastive_loss", "squared_hinge_loss", "tversky_loss",
]
