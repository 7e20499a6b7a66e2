"""The frozen base's fingerprint (what it holds; its reference is ``reference.py``'s), and verifying it.

The default fingerprint, ``checksum``, covers every frozen tensor's name, shape and values without a gather:
each rank sums what its ZeRO-3 shard holds, position-weighted, and the per-rank sums are added modulo a prime,
so the result is the same for any number of ranks. It is a checksum, not a cryptographic hash: ``sha256`` hashes
every frozen tensor's exact bytes (one gather per tensor) for when that matters. An fp32 tensor is checksummed cast
to bf16 (``value``) and to fp16 (``value_fp16``), a bf16 or fp16 one in its own cast only, so each narrow dtype
verifies exactly against fp32 or itself; why fp16 against bf16 cannot: docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Optional, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_frozen.errors import FrozenBaseMismatchError, InvalidArgumentValueError
from lightning_frozen.format import layout
from lightning_frozen.format.codec import Kernels
from lightning_frozen.hf import peft_adapters
from lightning_frozen.hf.reference import base_of
from lightning_frozen.progress import Progress
from lightning_frozen.zero import collectives
from lightning_frozen.zero.params import full_numel, full_shape, gathered, is_partitioned, local_shard, shard_range


class LoadedSums(Protocol):
    """What the fingerprint reads of the strategy's record of the base (``loaded.LoadedBase``): per-param sums kept as
    the values were read or encoded, and how many times it was written (a cached fingerprint is stale after that)."""

    changes: int

    def checksum(self, param: torch.Tensor) -> Optional[list[int]]: ...

    def sha256(self, param: torch.Tensor) -> Optional[str]: ...


_MODULUS = (1 << 61) - 1  # a Mersenne prime: per-rank sums add up exactly in Python ints
_WEIGHT_PERIOD = 65521  # largest prime below 2**16: position weights 1..65521
# elements per step: float64 sums of 2**20 products of a signed 16-bit pattern and a weight stay below 2**53, exact
_CHUNK = 1 << 20
FINGERPRINT_MODES = ("checksum", "sha256", "none")
# A fingerprint record, plain types only: {"mode", "digest", "tensors": {name: {"shape", "dtype", "value", ...}}}
Fingerprint = dict[str, Any]
# What takes one: the named frozen tensors and a mode in, a record out (fingerprint_base, or a FingerprintCache)
TakeFingerprint = Callable[[list[tuple[str, torch.Tensor]], str], Fingerprint]


# ---------------------------------------------------------------------------------------------- fingerprint


def named_frozen(
    module: nn.Module,
    recorded: Optional[Mapping[str, Any]] = None,
    trained: Optional[Mapping[str, Any]] = None,
    copies: Optional[Collection[str]] = None,
) -> list[tuple[str, torch.Tensor]]:
    """The module's tensors that the recorded fingerprint covers (by name), plus any other frozen ones; less those
    the adapted model does not compute with (``copies``, found in the module when not given:
    :func:`replaced_by_trained_copies`) and those the checkpoint holds trained values for (a finetuning callback
    unfroze them; they are loaded, not verified)."""
    params = dict(module.named_parameters())
    names = set(layout.fingerprint_tensors(recorded or {})) | {n for n, p in params.items() if not p.requires_grad}
    copies = replaced_by_trained_copies(module) if copies is None else copies
    skipped = set(copies) | set(trained or {})
    return [(n, params[n]) for n in sorted(names - skipped) if n in params]


def replaced_by_trained_copies(module: nn.Module) -> set[str]:
    """Params of the originals of PEFT's ``modules_to_save``: the adapted model computes with their trained copies
    (in the checkpoint) instead, and a head that ``from_pretrained`` created at random differs at every load."""
    return {name for prefix, submodule in module.named_modules() for name in trained_copy_originals(prefix, submodule)}


def trained_copy_originals(prefix: str, submodule: nn.Module) -> list[str]:
    """The names of the original params ``submodule`` (named ``prefix``) replaces with trained copies, if it is one of
    PEFT's ``modules_to_save`` wrappers (:func:`replaced_by_trained_copies`)."""
    if not peft_adapters.is_modules_to_save_wrapper(submodule):
        return []
    return [f"{prefix}.original_module.{name}".lstrip(".") for name, _ in submodule.original_module.named_parameters()]


def local_values(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of ``param`` this rank holds, flattened, and the global index of the first one."""
    if not is_partitioned(param):
        return param.detach().reshape(-1), 0
    start, count = shard_range(param)
    return local_shard(param).detach().reshape(-1)[:count], start


# the casts a tensor is checksummed in, by the fingerprint key each one is stored under
_CASTS = {layout.VALUE: torch.bfloat16, layout.VALUE_FP16: torch.float16}
# a narrow tensor is checksummed in its own cast only: its other one would match no other dtype
_OWN_CAST = {torch.bfloat16: [layout.VALUE], torch.float16: [layout.VALUE_FP16]}


def checksum_keys(dtype: torch.dtype) -> list[str]:
    """The checksums a tensor of ``dtype`` gets: both casts for fp32 (and wider), its own for bf16 or fp16."""
    if not dtype.is_floating_point:
        return [layout.VALUE]  # integer and bool params are rare: their low 16 bits stand for them
    return _OWN_CAST.get(dtype, list(_CASTS))


class Checksummer:
    """Plain and position-weighted sums of 16-bit patterns (of the values cast to bf16 or fp16), modulo a prime, in
    one pass of ``kernels`` where they take the values. Its buffers (about 29 MB) live as long as it: one per pass."""

    def __init__(self, kernels: Optional[Kernels] = None) -> None:
        self._kernels = kernels
        self._narrow: dict[str, torch.Tensor] = {}
        self._wide = self._weights = torch.empty(0)

    def __call__(self, values: torch.Tensor, start: int) -> list[int]:
        """``[plain, weighted]`` for each of ``checksum_keys(values.dtype)``, in that order: in one pass of the
        kernels where they take ``values``, else in chunks of tensor ops."""
        compiled = None if self._kernels is None else self._kernels.checksum(values, start)
        if compiled is not None:
            return compiled
        if not self._narrow:
            self._narrow = {key: torch.empty(_CHUNK, dtype=dtype) for key, dtype in _CASTS.items()}
            self._wide = torch.empty(len(_CASTS), _CHUNK, dtype=torch.float64)
            # weights 1..PERIOD repeated, long enough for any chunk starting at any phase
            self._weights = (torch.arange(_CHUNK + _WEIGHT_PERIOD, dtype=torch.int64) % _WEIGHT_PERIOD + 1).double()
        keys = checksum_keys(values.dtype)
        weights = self._weights
        sums = [0] * (2 * len(keys))
        for offset in range(0, values.numel(), _CHUNK):
            chunk = values[offset : offset + _CHUNK]
            count = chunk.numel()
            wide = self._wide[: len(keys), :count]
            for row, key in zip(wide, keys):
                if chunk.is_floating_point():
                    bits = self._narrow[key][:count]
                    bits.copy_(chunk)
                    row.copy_(bits.view(torch.int16))
                else:
                    row.copy_(chunk.to(torch.int64).bitwise_and(0xFFFF) - (1 << 15))
            phase = (start + offset) % _WEIGHT_PERIOD
            # integer-valued float64 sums below 2**53: exact in any summation order
            plain, weighted = wide.sum(dim=1).tolist(), torch.mv(wide, weights[phase : phase + count]).tolist()
            for index in range(len(keys)):
                sums[2 * index] = (sums[2 * index] + int(plain[index])) % _MODULUS
                sums[2 * index + 1] = (sums[2 * index + 1] + int(weighted[index])) % _MODULUS
        return sums


class ReadSums:
    """The sums of tensors another reader reads in chunks, in order (the merged export), each named by a stand-in (a
    meta tensor of its shape and dtype): a :class:`LoadedSums` for :func:`fingerprint_base`. Thread-safe."""

    changes = 0

    def __init__(self, mode: str, kernels: Optional[Kernels] = None) -> None:
        self.mode = mode
        self._checksummer = Checksummer(kernels) if mode == "checksum" else None
        self._sums: dict[int, list[int]] = {}
        self._hashes: dict[int, Any] = {}
        self._lock = threading.Lock()

    def add(self, stand_in: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Count ``values``, the elements of the tensor ``stand_in`` stands for (flattened) from index ``start``, in the
        dtype it was recorded in; chunks come in order."""
        with self._lock:
            self._add(stand_in, values.reshape(-1), start)

    def _add(self, stand_in: torch.Tensor, flat: torch.Tensor, start: int) -> None:
        if self._checksummer is not None:
            part = self._checksummer(flat, start)
            total = self._sums.get(id(stand_in))
            self._sums[id(stand_in)] = part if total is None else [(a + b) % _MODULUS for a, b in zip(total, part)]
        elif self.mode == "sha256":
            self._hashes.setdefault(id(stand_in), hashlib.sha256()).update(flat.view(torch.uint8).numpy())

    def checksum(self, param: torch.Tensor) -> Optional[list[int]]:
        return self._sums.get(id(param))

    def sha256(self, param: torch.Tensor) -> Optional[str]:
        hashed = self._hashes.get(id(param))
        return None if hashed is None else hashed.hexdigest()


def _world_sum(sums: list[list[int]], distributed: bool) -> list[list[int]]:
    if not distributed:
        return sums
    gathered = collectives.gather_objects(sums)
    return [
        [sum(rank[i][j] for rank in gathered) % _MODULUS for j in range(len(sums[i]))]  # type: ignore[index]
        for i in range(len(sums))
    ]


def param_sha256(param: torch.Tensor) -> str:
    """The sha256 of ``param``'s bytes, whole (a ZeRO-3 param is gathered; collective then)."""
    with gathered(param):
        return tensor_sha256(param.data)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The sha256 of a whole tensor's bytes, in its dtype."""
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _progress(named: list[tuple[str, torch.Tensor]], mode: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors; rank 0 logs how far it got every few seconds when the base is large."""
    progress = Progress(sum(full_numel(p) for _, p in named))
    for name, param in named:
        yield name, param
        if progress.advance(full_numel(param)):
            rank_zero_info(f"lightning-frozen: fingerprinting the frozen base ({mode}): {progress.status('elements')}")


def fingerprint_base(
    named_frozen: list[tuple[str, torch.Tensor]],
    mode: str = "checksum",
    loaded: Optional[LoadedSums] = None,
    kernels: Optional[Kernels] = None,
) -> Fingerprint:
    """The :data:`Fingerprint` of the named frozen tensors (full tensors or ZeRO-3 params); collective when
    distributed. Tensors whose sums ``loaded`` (the strategy's ``LoadedBase``) holds are not read again."""
    if mode not in FINGERPRINT_MODES:
        raise InvalidArgumentValueError(f"fingerprint mode must be one of {FINGERPRINT_MODES}, got {mode!r}.")
    named = sorted(named_frozen, key=lambda item: item[0])
    distributed = collectives.distributed() and any(is_partitioned(p) for _, p in named)
    tensors: dict[str, dict[str, Any]] = {}
    for name, param in named:
        tensors[name] = layout.tensor_record(full_shape(param), str(param.dtype).replace("torch.", ""))
    known = (lambda _: None) if loaded is None else loaded.checksum
    if mode == "checksum":
        checksum = Checksummer(kernels)
        pending = [(n, p) for n, p in named if known(p) is None]
        computed = {name: checksum(*local_values(param)) for name, param in _progress(pending, mode)}
        del checksum  # its buffers are not needed after the pass
        sums = [known(p) or computed[n] for n, p in named]
        for (name, param), world in zip(named, _world_sum(sums, distributed)):
            for index, key in enumerate(checksum_keys(param.dtype)):
                tensors[name][key] = f"{world[2 * index]:016x}{world[2 * index + 1]:016x}"
    elif mode == "sha256":
        hashed = (lambda _: None) if loaded is None else loaded.sha256
        # every rank takes the same branch for a tensor (the loader recorded it on all of them): gathers stay paired
        pending = [(n, p) for n, p in named if hashed(p) is None]
        computed = {name: param_sha256(param) for name, param in _progress(pending, mode)}
        for name, param in named:
            tensors[name][layout.VALUE] = hashed(param) or computed[name]
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    return layout.fingerprint_entry(mode, digest, tensors)


class FingerprintCache:
    """:func:`fingerprint_base`, computed once per set of names and mode and again when ``loaded`` changed: frozen
    params never change during a run."""

    def __init__(self, loaded: Optional[LoadedSums] = None, kernels: Optional[Kernels] = None) -> None:
        self._key: Optional[tuple[Any, ...]] = None
        self._value: Fingerprint = {}
        self.loaded = loaded
        self.kernels = kernels

    def clear(self) -> None:
        """Forget the cached fingerprint (the frozen base may have changed between runs)."""
        self._key = None

    def __call__(self, named_frozen: list[tuple[str, torch.Tensor]], mode: str) -> Fingerprint:
        """The fingerprint of ``named_frozen`` in ``mode``; collective when it is computed."""
        key = (mode, getattr(self.loaded, "changes", 0), *(name for name, _ in named_frozen))
        if self._key != key:
            self._value, self._key = fingerprint_base(named_frozen, mode, self.loaded, self.kernels), key
        return self._value


def comparable_value(recorded: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
    """The checksum under which a tensor recorded in one dtype and held in another compare exactly: the cast to fp16
    when either side is fp16, else the cast to bf16; None when the two have no such checksum (fp16 against bf16)."""
    dtypes = {recorded.get(layout.DTYPE), current.get(layout.DTYPE)}
    if {"float16", "bfloat16"} <= dtypes:
        return None
    key = layout.VALUE_FP16 if "float16" in dtypes else layout.VALUE
    return key if key in recorded and key in current else None


_IF_INTENDED = (
    "pass `verify_base=False` to `load_adapter` or `load_from_checkpoint`, or `fingerprint='none'` to the strategy"
)


def verify_base(
    recorded: Fingerprint,
    named_frozen: list[tuple[str, torch.Tensor]],
    reference: Optional[str],
    source: str,
    take_fingerprint: TakeFingerprint = fingerprint_base,
    bases: Optional[Mapping[str, str]] = None,
    if_intended: str = _IF_INTENDED,
) -> None:
    """Check the module's frozen tensors against a recorded fingerprint, the current one taken by ``take_fingerprint``;
    collective when distributed. ``bases``: each base's reference by module path; ``if_intended``: the message's advice.

    Raises:
        FrozenBaseMismatchError: names, shapes or values differ; the message names the reference (of the base each
            tensor belongs to, with several) and the first differing tensors.
    """
    mode = recorded.get(layout.FINGERPRINT_MODE, "none")
    if mode == "none":
        return
    current = take_fingerprint(named_frozen, mode)
    if current[layout.DIGEST] == recorded.get(layout.DIGEST):
        return
    expected, found = layout.fingerprint_tensors(recorded), layout.fingerprint_tensors(current)
    several = bases if bases and len(bases) > 1 else {}

    def of(name: str) -> str:  # with several bases, the one the tensor belongs to
        owner = base_of(name, several)
        return f"`{name}` (of {owner!r})" if owner else f"`{name}`"

    problems = [f"{of(n)} missing from the module" for n in sorted(set(expected) - set(found))]
    problems += [
        f"{of(n)} is frozen in the module but was not in the trained base" for n in sorted(set(found) - set(expected))
    ]
    for name in sorted(set(expected) & set(found)):
        want, have = expected[name], found[name]
        if want[layout.SHAPE] != have[layout.SHAPE]:
            problems.append(
                f"{of(name)} has shape {have[layout.SHAPE]}, the checkpoint's base had {want[layout.SHAPE]}"
            )
        elif (key := comparable_value(want, have)) is None:
            problems.append(
                f"{of(name)} is held in {have[layout.DTYPE]} here and was in {want[layout.DTYPE]} when trained, two"
                " roundings of"
                " the base that no checksum compares exactly: load the base in float32 or in the dtype it was trained"
                " in to verify it"
            )
        elif want.get(key) != have.get(key):
            held, trained = have[layout.DTYPE], want[layout.DTYPE]
            problems.append(f"{of(name)} holds different values ({held} here, {trained} when trained)")
    if not problems:
        return  # same names, shapes and values; only the dtype the base is held in differs
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    trained_on = f"the frozen base {reference or '<no reference recorded>'!r}"
    if several:
        trained_on = "the frozen bases " + ", ".join(f"{ref!r} (`{path}`)" for path, ref in sorted(several.items()))
    raise FrozenBaseMismatchError(
        f"{source} was trained on {trained_on}, but the module's frozen"
        f" parameters differ from it ({mode} fingerprint): {shown}. Load the base the adapter was"
        f" trained on; if the difference is intended, {if_intended}."
    )


def verify_checkpoint_base(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    source: str,
    take_fingerprint: TakeFingerprint = fingerprint_base,
    copies: Optional[Collection[str]] = None,
) -> None:
    """:func:`verify_base` of ``module`` against a checkpoint's ``frozen_base`` entry; the params the checkpoint holds
    trained values for are loaded, not verified, nor are ``copies`` (the module's
    :func:`replaced_by_trained_copies`, found when not given). Collective when distributed.

    Raises:
        FrozenBaseMismatchError: as :func:`verify_base`.
    """
    recorded = layout.fingerprint_of(checkpoint)
    skipped = set(replaced_by_trained_copies(module) if copies is None else copies)
    recorded_tensors = layout.fingerprint_tensors(recorded)
    if skipped & set(recorded_tensors):  # recorded by 0.1.0 and by `convert`: compared tensor by tensor
        tensors = {n: v for n, v in recorded_tensors.items() if n not in skipped}
        recorded = {**recorded, layout.TENSORS: tensors, layout.DIGEST: None}
    named = named_frozen(module, recorded, layout.state_dict_of(checkpoint), skipped)
    reference, bases = layout.reference_of(checkpoint), layout.bases_of(checkpoint)
    verify_base(recorded, named, reference, source, take_fingerprint, bases=bases)
