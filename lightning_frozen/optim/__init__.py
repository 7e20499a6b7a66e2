"""The optimizer side: what ``configure_optimizers`` returns, checked and its ``lr=0`` groups frozen (``filtering``),
every run's record of the groups the optimizer was built over (``trainable_groups``) and changing the trainable set
mid-run (``unfreezing``), which Lightning's finetuning callbacks (``finetuning.py``) reach through the strategy;
``schedulers`` keeps a call of earlier versions working."""
