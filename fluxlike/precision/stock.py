"""Policies for MLX's stock layers, so an unmodified ``mlx.nn`` model runs under autocast."""

import mlx.nn as nn

from .policy import autocast_policy

for _cls in (
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
    nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.MultiHeadAttention, nn.RNN, nn.GRU, nn.LSTM,
):
    autocast_policy("down")(_cls)

for _cls in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.InstanceNorm, nn.BatchNorm):
    autocast_policy("fp32")(_cls)

for _cls in (nn.Embedding, nn.Dropout):
    autocast_policy("none")(_cls)
