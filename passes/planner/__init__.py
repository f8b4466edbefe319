"""PipeDream's planner in parts (used by ``passes/partition_dp.py``, the entry point):

- ``options.py``: ``PlanOptions``, the planning options every entry point takes;
- ``blocks.py``: configurations (a tree of blocks, one pipeline per level) and their evaluation records;
- ``arrays.py``: a chain's per-layer costs as checked arrays and prefix sums;
- ``costs.py``: the cost models (``default``, ``paper``), each one object behind :class:`costs.CostModel`;
  ``pipedream.py``: the released optimizer's model, its evaluation and its own DP;
- ``memory.py``: the memory model (a stage's bytes per worker, and the tables the search reads);
- ``decisions.py``: the recomputation decision (which mode a stage runs, what it runs again), shared
  with the simulator;
- ``search.py``: ``PlanModel``, the bisection and vectorized search over the arrays the parts give it.

Pure functions over numpy arrays; no torch.
"""
