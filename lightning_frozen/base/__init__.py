"""The frozen base: loading it sharded from a hub folder (``pretrained``), what was read of it as it was loaded or
quantized (``loaded``), its fingerprint and verification (``fingerprint``) and a QLoRA ``quantization_config`` taken
as the strategy's ``frozen_dtype`` (``qlora``). Its storage formats are ``format/codec.py``'s, where it came from is
``hf/reference.py``'s."""
