"""The frozen base: loading it sharded from a hub folder (``pretrained``), what the loader read (``loaded``), its
fingerprint and verification (``fingerprint``), where it came from (``reference``) and its storage formats
(``codec``)."""
