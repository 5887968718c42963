"""oneDNN kernels as MLX primitives for fluxlike (CPU). Use it through ``fluxlike.native``,
which checks this build against the installed MLX before importing ``_ext``."""
