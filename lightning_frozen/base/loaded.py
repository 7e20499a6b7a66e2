"""What the sliced loader learnt about the frozen base as it read it, for the fingerprint and for setup.

A :class:`LoadedBase` (one per strategy, keyed weakly by param) keeps each slice's checksum (or hash) taken as it was
read and, with ``frozen_dtype``, which params were stored as codes then; a shard quantized later hands its source
values here too (:meth:`LoadedBase.source_keeper`), so it is the fingerprint's one source. Which params train is known
only at setup, so a param stored while loading keeps its file and key: until then a gather reads its exact values
from the file, and at setup a frozen one gets the quantized gather, a trainable one its exact slice back
(:meth:`LoadedBase.settle`).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lightning_frozen.base import slice_reads
from lightning_frozen.base.fingerprint import Checksummer, param_sha256, tensor_sha256
from lightning_frozen.errors import FrozenDtypeError
from lightning_frozen.zero import exact_gather, gathers
from lightning_frozen.zero.frozen_compute import KERNELS, compute_from_codes
from lightning_frozen.zero.frozen_storage import SourceValues, frozen_dtype_of, restore_values, store_codes
from lightning_frozen.zero.params import full_shape, local_shard, shard_range, storage_identity

_HASH_ELEMENTS = 1 << 22  # elements per piece when hashing a whole tensor from its file


@dataclass
class _Entry:
    dtype: torch.dtype  # the values were checksummed as the param holds them, in this dtype
    checksum: list[int]  # this rank's sums (see `frozen_base.Checksummer`)
    sha256: Optional[str] = None
    source: Optional[slice_reads.TensorSource] = None  # where the exact values of a param quantized while loading lie
    shard: Optional[tuple[int, int]] = None  # (data_ptr, version) of an unquantized shard as it was read
    exact_gathers: bool = False  # stored quantized while loading: gathers read `source` until setup
    settled: bool = False


class LoadedBase:
    """Per-param checksums (and sha256) taken from the values as the loader read them or as they were quantized; the
    sources of the params the loader stored quantized. Filled by the loader and by quantization, read by the
    fingerprint and by setup."""

    def __init__(self) -> None:
        # by id, with a weak reference to tell a reused id apart (tensors compare elementwise, so no WeakKeyDictionary)
        self._entries: dict[int, tuple[weakref.ref, _Entry]] = {}
        self.quantized_at_load = 0
        self.changes = 0  # entries put or rewritten: a fingerprint cached before is stale

    # ------------------------------------------------------------------ filled by the loader

    def record(
        self, param: nn.Parameter, values: torch.Tensor, start: int, checksum: Checksummer, sha256: Optional[str]
    ) -> None:
        """Keep this rank's checksum of ``values`` (its shard's elements from flat index ``start``, in the param's
        dtype) and the tensor's ``sha256`` if given; for an unquantized shard, which storage it was read into."""
        shard = local_shard(param)
        self._put(param, _Entry(values.dtype, checksum(values, start), sha256, shard=storage_identity(shard)))

    def _put(self, param: nn.Parameter, entry: _Entry) -> _Entry:
        self.changes += 1
        self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}  # forget params gone
        self._entries[id(param)] = (weakref.ref(param), entry)
        return entry

    def quantized(self, param: nn.Parameter, source: slice_reads.TensorSource) -> None:
        """``param``'s shard now holds codes (``store_codes``); ``source`` says where its exact values lie in the
        folder's files. Until setup its gathers read them (see the module docstring)."""
        entry = self.entry(param)
        assert entry is not None
        entry.source, entry.shard, entry.exact_gathers = source, None, True
        exact_gather.override_gathers(param, lambda p: self._lossless(p) is not None, self._read_exact, self._written)
        self.quantized_at_load += 1

    def _lossless(self, param: nn.Parameter) -> Optional[_Entry]:
        entry = self.entry(param)
        exact = entry is not None and entry.exact_gathers and entry.source is not None
        return entry if exact and not entry.settled else None

    def _read_exact(self, param: nn.Parameter) -> torch.Tensor:
        entry = self._lossless(param)
        assert entry is not None and entry.source is not None
        return entry.source.read(0, math.prod(entry.source.shape)).to(param.dtype).reshape(full_shape(param))

    def _written(self, param: nn.Parameter) -> None:
        # written while loading: its file no longer holds its values, its codes will
        entry = self._lossless(param)
        assert entry is not None
        start, count = shard_range(param)
        values = param.data.detach().reshape(-1)[start : start + count]
        self.keep_source(param, values, start, param.data)
        entry.source = None
        store_codes(param, values, frozen_dtype_of(param), KERNELS)
        self.settle_one(param, entry)

    # ------------------------------------------------------------------ kept in the code cache

    def saved(self, param: nn.Parameter) -> Optional[list]:
        """What was recorded for ``param`` as plain values (the code cache keeps them), or None."""
        entry = self.entry(param)
        return None if entry is None else [str(entry.dtype).removeprefix("torch."), entry.checksum, entry.sha256]

    def restore(
        self, param: nn.Parameter, saved: Optional[list], source: Optional[slice_reads.TensorSource] = None
    ) -> None:
        """``param``'s shard was mapped from the code cache: what was recorded when it was stored (:meth:`saved`);
        with ``source``, it holds codes stored while loading, as :meth:`quantized` says."""
        if saved is not None:
            dtype, checksum, sha256 = saved
            self._put(
                param, _Entry(getattr(torch, dtype), checksum, sha256, shard=storage_identity(local_shard(param)))
            )
            if source is not None:
                self.quantized(param, source)

    def moved(self, param: nn.Parameter) -> None:
        """``param``'s shard now lies elsewhere with the same bytes (the code cache's file): its record holds."""
        entry = self.entry(param)
        if entry is not None and entry.shard is not None:
            entry.shard = storage_identity(local_shard(param))

    # ------------------------------------------------------------------ filled by quantization

    def keep_source(
        self, param: nn.Parameter, values: torch.Tensor, start: int, whole: Optional[torch.Tensor] = None
    ) -> None:
        """``param``'s shard is about to hold the codes of ``values`` (this rank's elements from flat index ``start``,
        in its dtype; a ``SourceValues``): their checksum, and the sha256 of ``whole`` (the whole tensor) when it
        is given, stand for ``param`` in the fingerprint from now on."""
        self._keep(param, values, start, tensor_sha256(whole) if whole is not None else None)

    def source_keeper(self, fingerprint_mode: str) -> SourceValues:
        """What setup's quantization tells the source values to: :meth:`keep_source`, and in ``sha256`` mode the
        whole tensor's hash, gathered while its shard still holds them (collective then)."""
        if fingerprint_mode != "sha256":
            return self.keep_source

        def keep(param: nn.Parameter, values: torch.Tensor, start: int, whole: Optional[torch.Tensor]) -> None:
            self._keep(param, values, start, tensor_sha256(whole) if whole is not None else param_sha256(param))

        return keep

    def _keep(self, param: nn.Parameter, values: torch.Tensor, start: int, sha256: Optional[str]) -> None:
        entry = self.entry(param) or self._put(param, _Entry(values.dtype, []))
        self.changes += 1
        entry.dtype, entry.checksum, entry.sha256 = values.dtype, Checksummer(KERNELS)(values, start), sha256
        entry.shard = None  # the record holds for the codes, which only a write replaces (and reports here)

    def entry(self, param: nn.Parameter) -> Optional[_Entry]:
        """What was recorded for ``param``, if anything."""
        found = self._entries.get(id(param))
        return found[1] if found is not None and found[0]() is param else None

    def stored_while_loading(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s shard was stored as codes as the loader read it."""
        entry = self.entry(param)
        return entry is not None and entry.exact_gathers

    # ------------------------------------------------------------------ read by the fingerprint

    def checksum(self, param: nn.Parameter) -> Optional[list[int]]:
        """This rank's checksum of ``param`` as loaded, or None when it must be taken from the shard (not loaded here,
        written since, or cast to another dtype)."""
        entry = self.entry(param)
        if entry is None or entry.dtype != param.dtype:
            return None
        shard = local_shard(param)
        if entry.shard is not None and entry.shard != storage_identity(shard):
            return None
        return entry.checksum

    def sha256(self, param: nn.Parameter) -> Optional[str]:
        """The whole tensor's sha256 as loaded (``sha256`` fingerprint mode), or None (see :meth:`checksum`)."""
        entry = self.entry(param)
        return entry.sha256 if entry is not None and self.checksum(param) is not None else None

    # ------------------------------------------------------------------ setup

    def settle(self, model: nn.Module) -> None:
        """Before the engine is built: each param quantized while loading that is frozen now computes through the
        quantized gather; each trainable one gets its exact values back from its file, in the compute dtype.

        Raises:
            FrozenDtypeError: a trainable param's exact values are gone (it was written under
                ``GatheredParameters`` while loading); the message names it and the fix.
        """
        for name, param in model.named_parameters():
            entry = self.entry(param)
            if entry is None or not entry.exact_gathers:
                continue
            if param.requires_grad:
                if entry.source is None:
                    raise FrozenDtypeError(
                        f"`{name}` trains, but it was stored as {frozen_dtype_of(param)} while loading and then"
                        " written, so its exact values are gone. Keep it frozen, or pass `frozen_dtype=None`."
                    )
                gathers.use_deepspeed(param)
                restore_values(param, entry.source.read(*shard_range(param)).to(param.dtype))
                del self._entries[id(param)]
            elif not entry.settled:
                self.settle_one(param, entry)

    def settle_one(self, param: nn.Parameter, entry: _Entry) -> None:
        """``param`` computes through the quantized gather from now on; a write to it reports its new values here."""
        assert entry.exact_gathers
        compute_from_codes(param, self.keep_source)
        entry.settled = True


def source_sha256(source: slice_reads.TensorSource, dtype: torch.dtype) -> str:
    """The sha256 of the whole tensor ``source`` gives, in ``dtype`` (``frozen_base``'s ``sha256`` mode): its runs read
    a few MiB at a time, in order; one it builds is built whole."""
    total = math.prod(source.shape)
    if source.build is not None:
        return tensor_sha256(source.read(0, total).to(dtype))
    digest = hashlib.sha256()
    reads = [source.reads(first, min(_HASH_ELEMENTS, total - first)) for first in range(0, total, _HASH_ELEMENTS)]
    with slice_reads.read_ahead(reads) as pieces:
        for values in pieces:
            digest.update(values.to(dtype).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
