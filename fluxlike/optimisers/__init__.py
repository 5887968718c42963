"""Optimisation, as in Optimisers.jl: the rules (``rules``: Descent to Lion, clipping and
weight decay; ``adaptive``: the rest of the Adam family; ``signs``: Rprop, Signum, SignDecay;
``accumulate``: AccumGrad), the state of one model's optimiser with ``setup`` and ``update``
(``state``), its hyperparameters changed live by ``adjust`` and recorded in checkpoints
(``hyperparameters``), and the compiled step behind ``update`` (``compiled``)."""
