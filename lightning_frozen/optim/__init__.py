"""The optimizer side: frozen params stripped from what ``configure_optimizers`` returns (``filtering``), LR
schedulers following param groups (``schedulers``), the trainable set and changing it mid-run (``unfreezing``) and
Lightning's finetuning callbacks under ZeRO-3 (``finetuning``)."""
