"""Everything about dtypes: the autocast scope, the dispatch barrier and per-layer policies,
the compute kernels' dtype rules, storage converters and loss scaling."""
