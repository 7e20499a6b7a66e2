"""The checkpoint file: its layout, write, read and validation (``file``), the trainable state gathered into it
(``trainable_state``), atomic writes (``atomic_files``), per-adapter entries (``adapters``), and the ways out:
loading without DeepSpeed (``loading``), PEFT export (``peft_export``) and conversion of stock DeepSpeed
checkpoints (``convert``)."""
