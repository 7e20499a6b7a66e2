"""The frozen base: loading it sharded from a hub folder (``pretrained``), what was read of it as it was loaded or
quantized (``loaded``), its fingerprint and verification (``fingerprint``), where it came from (``reference``) and its
storage formats (``codec``)."""
