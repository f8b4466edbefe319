"""The annotate-costs pass's parts, one concern a module: running single nodes (``nodes``), timing
(``measure``), FLOP counting (``flops``) and the analytic roofline (``roofline``), what autograd
saves (``saved``), the split of a backward into input and weight gradients (``split``), parameter
bytes (``params``), sizes as expressions of the batch (``symbolic``) and the profile file
(``profile``). ``passes/annotate_costs.py`` runs them."""
