"""The DeepSpeed seam: everything that reaches into DeepSpeed's ZeRO-3 lives in this subpackage.

It builds the engine over frozen and trainable shards (``engine``), makes DeepSpeed's accelerator match Lightning's
(``accelerator``), reads and writes whole ZeRO-3 tensors and optimizer state (``params``), stores frozen shards in a
smaller dtype and gathers them (``quantized``), keeps ``zero.Init``'s stand-in shards unwritten while a loader fills
them (``placeholders``), bounds host memory on the CPU accelerator (``host_memory``), owns the DeepSpeed config and
the reduce bucket's size (``config``) and clips per adapter inside ZeRO-3's step (``adapter_clipping``). Modules
outside it do not import ``deepspeed`` or touch ``ds_*`` attributes.
"""
