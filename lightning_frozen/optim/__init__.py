"""The optimizer side: frozen params stripped from what ``configure_optimizers`` returns (``filtering``), LR
schedulers following param groups (``schedulers``), every run's record of the groups the optimizer was built over
(``trainable_groups``) and changing the trainable set mid-run (``unfreezing``), which Lightning's finetuning callbacks
(``finetuning.py``) reach through the strategy."""
