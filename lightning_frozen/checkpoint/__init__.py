"""The checkpoint file: write, read and validation (``file``), the trainable state gathered into it
(``trainable_state``) and streamed as it is written (``streamed_save``), atomic writes (``atomic_files``), per-adapter
entries (``adapter_entries``), and the ways out: loading without DeepSpeed (``loading``), PEFT export (``peft_export``),
the adapter folded into the base for serving (``merged_export``) and conversion of stock DeepSpeed checkpoints
(``convert``). The keys it is written with are ``format/layout.py``'s."""
