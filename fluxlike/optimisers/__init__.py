"""Optimisation, as in Optimisers.jl: the rules (``rules``), the state of one model's
optimiser with ``setup`` and ``update`` (``state``), and the compiled step behind ``update``
(``compiled``)."""
