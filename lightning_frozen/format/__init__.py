"""The ground floor's formats, on plain dicts and tensors, importing nothing of the package but ``errors``: the
checkpoint file's layout (``layout``: every key a named constant, the one builder, the readers) and the frozen base's
storage codec (``codec``: block-wise int8 and NF4, bf16/fp16 casts; run by the CPU kernels of ``codec_kernels.c``
through ``native_codec`` and, on CUDA, by bitsandbytes' NF4 kernel through ``bitsandbytes_nf4``)."""
