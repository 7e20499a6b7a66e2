"""The DeepSpeed seam: everything that reaches into DeepSpeed lives in this subpackage, written for DeepSpeed 0.19, and
so do the few private names of torch the package relies on (listed with the functions below).

Outside it no module imports ``deepspeed`` (other than for type hints), touches a ``ds_*`` attribute of a ZeRO-3 param
or an internal of DeepSpeed's engine and optimizer, or uses a private DeepSpeed name; ``tests/test_seams.py`` checks it.
When DeepSpeed changes, this is the one place to change. Inside, it reads and writes ``ds_*`` attributes, reads and
writes whole fp32 weights and optimizer state through ``deepspeed.utils``' public ``safe_get_*`` and ``safe_set_*``
(working around two of their bugs, ``params``), and reaches DeepSpeed's and torch's private names: each is a row of
``capabilities.py``, under the core or the capability that needs it, naming the module that uses it. The teardown's
reaches are guarded (``foreign_names.reaching``), so that a moved name warns rather than hiding the error that ended a
run.

The surface other modules call, by module (``tests/test_seams.py`` checks that it is complete and that each name
is defined where it is listed):

- ``params``: one ZeRO-3 param, its shard and its whole value: ``is_partitioned``, ``full_numel``, ``full_shape``,
  ``shard_numel``, ``shard_range``, ``local_shard``, ``is_released``, ``mark_gathered``, ``gathered``,
  ``full_param``, ``set_full_param``; the ZeRO-3 optimizer's state by param, world-size independent:
  ``optimizer_state_of``, ``optimizer_state_with``, ``ensure_optimizer_state``, ``set_optimizer_state``,
  ``loss_scaler_state``,
  ``scaler_state``, ``restore_loss_scaler``; a save's whole tensors, gathered to the writing rank alone:
  ``gather_to_writer``, ``whole_on_meta``, ``WRITER_RANK``;
  and ``check_has_trainable``, ``compute_dtype``; torch's own: ``persistent_buffers`` (the buffers a
  module's state dict holds), ``storage_identity`` (from a tensor's version counter).
- ``init``: ``deepspeed.zero.Init`` and importing DeepSpeed: ``sharded_creation``, ``outside_zero_init``,
  ``import_deepspeed``, ``linear_restorer``, ``deepspeed_linear_copy`` (the copy of
  ``F.linear`` that ``zero.Init`` keeps on a class, for the run's ledger to put back).
- ``engine``: the engine over frozen and trainable shards, and its release after a run: ``Placement``,
  ``initialize_engine``, ``detach_frozen_shards``, ``destroy_engine``, ``release_engine``.
- ``accelerator``: DeepSpeed's accelerator matched to Lightning's for a run: ``deepspeed_accelerator_matching``,
  ``ignore_dependency_deprecations``; the line said before it compiles its CPU op: ``shared_memory_op_build_note``,
  ``torch_extensions_folder``.
- ``optimizers``: DeepSpeed's CPU Adam, the inner optimizer, the engine's counters, the groups its engine would drop:
  ``is_cpu_adam``, ``cpu_adam``, ``cpu_adam_is_adamw``, ``inner_optimizer``, ``engine_counters``,
  ``set_engine_counters``, ``keep_empty_groups``; torch's schedulers: ``scheduler_chain``, ``point_schedulers_at``,
  ``SUB_SCHEDULER_KEYS`` (the schedulers inside SequentialLR and ChainedScheduler).
- ``frozen_storage``: frozen shards stored below the compute dtype, as the core sees them (the kernels handed in):
  ``frozen_dtype_of``, ``store_codes``, ``store_encoded``, ``restore_values``, ``keeps_a_copy``, ``check_config``,
  ``SourceValues``.
- ``frozen_files``: frozen shards in a file every rank of a machine maps (the code cache's, ``/dev/shm``'s):
  ``MappedFile``, ``layout``, ``reserve``, ``open_file``, ``write_index``, ``read_index``, ``place``,
  ``mapped_together``, ``sharding``, ``stored_bytes``, ``creation_order``, ``rows_of``, ``file_of``,
  ``owned_bytes``.
- ``frozen_compute``: the one door to how frozen shards are gathered and computed, chosen per device (behind it,
  ``compute/``: the quantized gather, and the CPU's compiled kernels, layers computed from codes, decode buffers and
  host-memory settings): ``frozen_compute_for``, ``FrozenCompute``,
  ``compute_from_codes``, ``KERNELS`` (the compiled passes the core takes as a value), ``exit_cleanly`` (a gloo
  group destroyed at exit and its workers left idle, ``zero/compute/gloo_exit.py``, read in /proc).
- ``gathers``: which gather methods each ZeRO-3 param has over its life, and DeepSpeed's own: ``use``,
  ``use_deepspeed``, ``deepspeed_method``, ``kind_of``, ``DEEPSPEED``, ``EXACT_FROM_FILE``, ``QUANTIZED``.
- ``placeholders``: ``zero.Init``'s shards left unwritten while the loader fills them, and its broadcast of each
  weight from rank 0 skipped meanwhile: ``untouched_while_loading``, ``not_broadcast_while_loading``.
- ``exact_gather``: a param's gathers answered without a collective, a write handed back: ``override_gathers``.
- ``forward_trace``: ZeRO-3's trace reset once per outermost call, so a step calling ``self(x)`` prefetches:
  ``reset_trace_at_outermost_call``, ``restore_trace_reset``.
- ``collectives``: the package's own collectives (a flag any rank raised, a value from every rank), through
  DeepSpeed's communication module, apart from ZeRO's gathers of params: ``gather_objects``, ``any_rank``,
  ``distributed``.
- ``checkpoint_files``: what a stock DeepSpeed ZeRO-3 checkpoint directory holds: ``shard_files``,
  ``pickled_classes``, ``read_model_states``, ``read_fp32_tensors``, ``merge_trainable``, ``loss_scaler_of``,
  ``ENGINE_STATE_KEYS``.
- ``config``: what the DeepSpeed config says about ZeRO: ``ZeroSettings``, ``zero_settings``,
  ``fitted_reduce_bucket``, ``fit_reduce_bucket``, ``inference_config``.
- ``whole``: ZeRO-3 params made plain tensors again after a run: ``unshard``, ``still_sharded_notice`` (the line a run
  ends with where they are shards).
- ``gather_once``: a model's params gathered whole for one call of its generate, its modules' fetches and releases
  bypassed meanwhile: ``gathered_once``, ``whole_bytes`` (its size whole in the compute dtype), ``available_bytes``
  (the free memory of the device that computes).
- ``adapter_clipping``: per-adapter gradient clipping inside ZeRO-3's step, each adapter at its own value:
  ``clip_per_adapter``, ``check_group_clips``, ``GROUP_CLIP_KEY``.
- ``torch_file``: a ``torch.save`` file written in two passes, its structure then each tensor's bytes as they come:
  ``save_in_two_passes``, ``with_values``, ``Put``.
"""
