"""Policy: which recipe runs, decided from what is measured — kept apart from the mechanisms (``strategies/``).

- :mod:`.auto_choice` — the recipe ``compression="auto"`` gives an optimizer on a layout (under the DDP wrapper,
  and under ``gradientflow.fsdp``), and the ranks' agreement on it;
- :mod:`.width` — 3 bits or 2 for an Adam-type optimizer on two ranks, decided by measurement on the link;
- :mod:`.pitfalls` — optimizer settings the top-k recipes are measured to handle badly (the warnings of
  ``check_optimizer``).

Every name they give is a row of the one recipe table (:mod:`gradientflow.recipes`).
"""
