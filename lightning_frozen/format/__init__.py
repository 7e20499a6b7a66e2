"""The ground floor's formats, on plain dicts and tensors, importing nothing of the package but ``errors``: the
checkpoint file's layout (``layout``: every key a named constant, the one builder, the readers) and the frozen base's
storage codec (``codec``: block-wise int8 and NF4, bf16/fp16 casts, in tensor ops, and on CUDA bitsandbytes' NF4 kernel
through ``bitsandbytes_nf4``). The CPU kernels of ``codec_kernels.c`` (``native_codec``, and ``partial_decode``, which
only they run) are machinery behind ``zero/frozen_compute.py``: the codec runs them when they are handed in."""
