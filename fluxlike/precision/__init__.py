"""Everything about dtypes: the autocast scope, per-layer policies and the routing of calls,
the compute kernels' dtype rules, storage converters and loss scaling."""
