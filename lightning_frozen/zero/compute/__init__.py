"""How frozen shards stored as codes are gathered and computed: behind ``zero/frozen_compute.py``, the one door the
rest of the package uses (``tests/test_structure.py`` fails on a core module that imports one of these).

- ``quantized``: shards quantized at setup, their asynchronous gather and decoding, on any device.
- The CPU's performance stack: ``coded_linear`` (layers computed from their gathered codes, a few rows at a time),
  ``coded_experts`` (a MoE layer's fused experts likewise, only those the router picks), ``host_memory`` (ZeRO-3's
  gather bounds, glibc's mmap threshold, the decode buffers); with ``format/native_codec.py``'s compiled kernels. The
  codes every rank of a machine maps (``zero/frozen_files.py``) are the core's: the loader writes them too.
"""
