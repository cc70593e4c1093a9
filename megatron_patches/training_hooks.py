"""The hooks that switch DHelix into `megatron.training.pretrain` without forking Megatron
(installed by `dhelix.megatron_lm`, megatron-core 0.19 tested).

1. Arguments (`megatron.training.arguments.parse_args`, which `parse_and_validate_args` and
   every pretrain script call): the script's own `extra_args_provider` still runs; the
   `--dhelix*` arguments (`dhelix.dhelix_arguments.add_dhelix_runtime_args`) are added
   after it, and a command line argparse rejects ends in one `error: ...` line, not the usage text
   (`megatron_patches.argument_errors`). Every run (with or without `--dhelix`) first gets
   the adaptations its machine needs (`megatron_patches.machine_arguments`: gloo and no CUDA
   kernel fusions on CPU; on a GPU without Transformer Engine or Apex, the local spec and no
   fusions their kernels provide), named in one line on rank 0; more ranks on a node than
   GPUs stop the run with one `error: ...` line (neither NCCL nor gloo can train them).
   Right after parsing, before Megatron validates anything and before any process group
   exists, the arguments are checked (`dhelix.megatron_lm_checks.check_plugin_args`): an
   argument the DHelix runtime cannot honour, a `--dhelix-plan`/`--dhelix-profile` file that
   is missing, corrupt or of another version, or one given without `--dhelix`, stops the run
   with one `error: ...` line naming it (exit code 2). After Megatron's `validate_args` the
   typed run is built and checked once (`megatron_patches.run_options`; with
   `--use-checkpoint-args` the `--dhelix` refusals wait for it, to see the checkpoint's
   values).
2. The folded model (`--dhelix` with PP > 1, see `megatron_patches.folded_model`):
   Megatron's parallel state gets the folded embedding group (first stage only), and
   `GPTModelBuilder.build_model` (the model-config path of `pretrain`, Megatron-LM 0.19's
   pretrain_gpt.py) builds this stage's `FoldedGPTModel` from the same config, layer spec and
   seed instead of a stock GPTModel stage.
3. Mixed precision (`GPTModelBuilder.build_distributed_models`, whose
   `mixed_precision_wrapper` defaults to megatron-core's `Float16Module`, applied with
   `--bf16`): a folded stage is wrapped in
   `megatron_patches.folded_float16.FoldedFloat16Module`, which converts at the folded
   model's ends (both on stage 0) instead of on the first and last pipeline stages; a
   wrapper the caller chose itself is kept.
4. The forward/backward function (`megatron.training.training.get_forward_backward_func`,
   imported by name and called by `train()` and `evaluate()`): with `--dhelix` it returns
   the DHelix schedule built for the model `setup_model_and_optimizer` returned
   (`dhelix.runtime.setup.setup_dhelix`, from the typed run); Megatron's no_sync / grad-sync / param-sync /
   finalize hooks reach it through the model config, as they reach Megatron's schedules.

4. Core attention (`megatron.training.models.gpt.default_layer_spec`, called by
   `GPTModelBuilder.build_model`): with `--dhelix-attention sdpa`, with or without `--dhelix`,
   the local spec's `DotProductAttention` becomes `SDPAttention`
   (`megatron_patches.sdpa_attention`); arguments it cannot honour stop the run at parse time.

Without `--dhelix` (and with the default `--dhelix-attention megatron`) hooks 2-4 hand the
call to Megatron unchanged. What applies to every run, with or without `--dhelix`:

5. Checkpoints (`megatron.training.checkpointing.save_checkpoint` / `load_checkpoint`, as
   `pretrain()` calls them, see `megatron_patches.checkpoint_guard`): a `torch_dist` save
   writes a checksum manifest before its iteration becomes "latest" and starts no process
   that could outlive a killed rank; a load verifies the files it reads first and refuses a
   damaged checkpoint with one `error: ...` line naming the file.
6. A NaN/inf found by Megatron's `--check-for-nan-in-loss-and-grad` (its rerun state
   machine, `should_checkpoint_and_exit`) ends the run with one `error: ...` line and no
   checkpoint (`megatron_patches.nan_stop`).
7. A stalled rank (`megatron.training.pretrain`, see `megatron_patches.stall_roll_call`):
   when a collective times out after `--distributed-timeout-minutes`, the ranks still
   running name the one that stopped answering in one `error: ...` line and end the job.
8. The wheel's prebuilt dataset helpers are used instead of compiling them
   (`megatron_patches.compat.use_prebuilt_dataset_helpers`).
9. Megatron's argument help texts (its config dataclasses' field docstrings, read from
   their source by every `parse_args`) are read once per process
   (`megatron_patches.argument_docstrings`).
"""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta

from dhelix.dhelix_arguments import add_dhelix_runtime_args
from megatron_patches.argument_errors import one_line_parser_errors
from megatron_patches.machine_arguments import MachineRefused, adapt_to_this_machine


def _with_dhelix_args(extra_args_provider):
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        add_dhelix_runtime_args(parser)
        one_line_parser_errors(parser)
        return parser

    return provider


def _hook_parse_args(arguments) -> None:
    original = arguments.parse_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(_with_dhelix_args(extra_args_provider), ignore_unknown_args)
        try:
            adapt_to_this_machine(args)
        except MachineRefused as exc:
            _fail(str(exc))
        _check_attention(args)
        from dhelix.megatron_lm_checks import UnsupportedArgument, check_plugin_args

        # with --use-checkpoint-args the --dhelix refusals see the checkpoint's values, once
        # loaded (megatron_patches.run_options)
        try:
            check_plugin_args(args, dhelix_refusals=not args.use_checkpoint_args)
        except UnsupportedArgument as exc:
            _fail(str(exc))
        _no_unread_attention_masks(args)
        return args

    parse_args.__dhelix_original__ = original  # read by `install_training_hooks`
    arguments.parse_args = parse_args


def _no_unread_attention_masks(args) -> None:
    """With `--dhelix`, Megatron's data loader builds no attention mask
    (`--no-create-attention-mask-in-dataloader`): the DHelix layers apply the causal mask
    inside the attention kernel and never read it, and building it costs a [b, 1, s, s]
    bool tensor per micro-batch on the host plus its copy to the device (16 MB per sample
    at seq 4096). Measured on one H100 (scripts/bench_gpu.py, 4 Llama-8B layers): without
    it the `--dhelix` steps came 1.6% (dp) and 5.0% (sequential) above stock Megatron with
    SDPA, with it 5.2% and 6.0%, the loader's work then left the GPU idle between
    micro-batches. Rank 0 prints one line when it changes the setting."""
    if args.dhelix and args.create_attention_mask_in_dataloader:
        args.create_attention_mask_in_dataloader = False
        if args.rank == 0:
            print("dhelix: --no-create-attention-mask-in-dataloader (the DHelix layers apply "
                  "the causal mask in the kernel and never read the loader's mask)",
                  flush=True)


def _check_attention(args) -> None:
    from megatron_patches.sdpa_attention import SDPAttentionError, check_attention_args

    try:
        check_attention_args(args)
    except SDPAttentionError as exc:
        _fail(str(exc))


class _Run:
    """What the hooks learned about this run: the DHelix set-up once the model exists
    (`setup`, a `dhelix.runtime.setup.DHelixSetup`) and the schedule built on it."""

    forward_backward = None
    setup = None

    @classmethod
    def forget(cls) -> None:
        """No run learned yet: a new `pretrain()` starts afresh, and a closed run's set-up
        (and the process groups it holds) is not kept here."""
        cls.forward_backward = cls.setup = None


def _megatron_args():
    from megatron.training import get_args

    return get_args()


def _folded(args) -> bool:
    from dhelix.folding import uses_folded_model

    return uses_folded_model(args)


def _fail(message: str):
    from dhelix.rank_errors import exit_with_error

    exit_with_error(message)


def _hook_parallel_state(parallel_state) -> None:
    """The folded model keeps both ends of the tied embedding on stage 0: its embedding group
    is the first stage only (whatever `get_embedding_ranks` the script passes)."""
    original = parallel_state.initialize_model_parallel

    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        if _folded(_megatron_args()):
            from dhelix.parallel import folded_embedding_ranks

            kwargs["get_embedding_ranks"] = folded_embedding_ranks
        return original(*args, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel


def build_folded_stage(model_config, pg_collection, seed: int):
    """This rank's `FoldedGPTModel` for a Megatron `GPTModelConfig`: the layer spec, final
    norm and padded vocabulary `GPTModelBuilder.build_model` would use for a stock stage,
    and stock Megatron's initial weights for `seed` (`megatron_patches.folded_model`).
    `pretrain()` draws random tensors for its JIT warm-up between seeding a stage and
    building its model (`initialize._warmup_jit_function`, called by
    `set_jit_fusion_options`); each replayed stage stream replays that warm-up too."""
    from megatron.training import initialize
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.utils import get_pg_rank
    from megatron.training.models.gpt import default_layer_spec

    from dhelix.folding import FoldedLayout
    from megatron_patches.folded_model import FoldedGPTModel

    spec = model_config.transformer_layer_spec
    if spec is None:
        spec = default_layer_spec(model_config, None)
        if not isinstance(spec, ModuleSpec):
            spec = _moe_layer_specs(model_config, spec)
    elif not isinstance(spec, ModuleSpec) and callable(spec):
        spec = spec(model_config)
    if not isinstance(spec, (ModuleSpec, list)):
        _fail("--dhelix with --pipeline-model-parallel-size > 1 needs one transformer-layer "
              "spec for every layer, or Megatron's MoE block spec; this model has another "
              "block spec (heterogeneous or experimental layers)")
    vocab = model_config.vocab_size
    if model_config.should_pad_vocab:
        from megatron.training.vocab_utils import calculate_padded_vocab_size

        vocab = calculate_padded_vocab_size(vocab, model_config.make_vocab_size_divisible_by,
                                            model_config.transformer.tensor_model_parallel_size)
    config = model_config.transformer
    return FoldedGPTModel(
        config=config, transformer_layer_spec=spec,
        final_norm=transformer_block.LayerNormImpl,
        layout=FoldedLayout(config.num_layers, config.pipeline_model_parallel_size),
        stage=get_pg_rank(pg_collection.pp), vocab_size=vocab,
        max_sequence_length=model_config.seq_length, seed=seed,
        share_embeddings_and_output_weights=model_config.share_embeddings_and_output_weights,
        position_embedding_type=model_config.position_embedding_type,
        rotary_percent=model_config.rotary_percent, rotary_base=model_config.rotary_base,
        pg_collection=pg_collection,
        rng_prelude=functools.partial(initialize._warmup_jit_function,
                                      tp_size=config.tensor_model_parallel_size))


def _moe_layer_specs(model_config, stage_block):
    """Every global layer's spec of the MoE stack `default_layer_spec` gave this stage as
    `stage_block` (Megatron's `get_gpt_decoder_block_spec`: the `--moe-layer-freq` pattern's
    MoE and dense layer specs, sliced to the stock stage's layers), from the same
    `get_gpt_decoder_layer_specs` call before slicing (with the core attention
    `--dhelix-attention` asks for, as `_hook_default_layer_spec` gives the stage);
    `stage_block` returned unchanged when it is not that spec (no MoE, or this stage's
    slice differs). Specs are compared by their repr: Megatron's MoE layer specs hold
    `functools.partial` objects, which compare by identity, and a repr names the same
    classes, functions and arguments."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_patches.sdpa_attention import layer_spec_for

    config = model_config.transformer
    if config.num_moe_experts is None:
        return stage_block
    specs = get_gpt_decoder_layer_specs(
        config, config.transformer_impl == "transformer_engine",
        normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    specs = [layer_spec_for(spec, _megatron_args().dhelix_attention) for spec in specs]
    offset = get_transformer_layer_offset(config)
    stage_specs = list(getattr(stage_block, "layer_specs", ()))
    if repr(specs[offset:offset + len(stage_specs)]) != repr(stage_specs):
        return stage_block
    return list(specs)


def _hook_model_builder(gpt_models) -> None:
    original = gpt_models.GPTModelBuilder.build_model

    @functools.wraps(original)
    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        args = _megatron_args()
        if not _folded(args):
            return original(self, pg_collection, pre_process, post_process, vp_stage)
        return build_folded_stage(self._model_config, pg_collection, args.seed)

    gpt_models.GPTModelBuilder.build_model = build_model

    original_distributed = gpt_models.GPTModelBuilder.build_distributed_models
    signature = inspect.signature(original_distributed)

    @functools.wraps(original_distributed)
    def build_distributed_models(self, *args, **kwargs):
        if not _folded(_megatron_args()):
            return original_distributed(self, *args, **kwargs)
        from megatron.core.transformer.module import Float16Module

        from megatron_patches.folded_float16 import float16_module

        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["mixed_precision_wrapper"] is Float16Module:
            bound.arguments["mixed_precision_wrapper"] = float16_module
        return original_distributed(*bound.args, **bound.kwargs)

    gpt_models.GPTModelBuilder.build_distributed_models = build_distributed_models


def _hook_default_layer_spec(gpt_models) -> None:
    """`--dhelix-attention sdpa`, stock and `--dhelix` alike: the spec Megatron's
    `default_layer_spec` returns (called by `GPTModelBuilder.build_model` and
    `build_folded_stage`) gets SDPA core attention (`megatron_patches.sdpa_attention`)."""
    from megatron_patches.sdpa_attention import SDPAttentionError, layer_spec_for

    original = gpt_models.default_layer_spec

    @functools.wraps(original)
    def default_layer_spec(config, vp_stage):
        try:
            return layer_spec_for(original(config, vp_stage), _megatron_args().dhelix_attention)
        except SDPAttentionError as exc:
            _fail(str(exc))

    gpt_models.default_layer_spec = default_layer_spec


def _hook_training(training) -> None:
    from megatron_patches.checkpoint_guard import forget_last_checkpoint

    setup_model_and_optimizer = training.setup_model_and_optimizer
    get_forward_backward_func = training.get_forward_backward_func

    @functools.wraps(setup_model_and_optimizer)
    def setup(*args, **kwargs):
        _Run.forget()
        forget_last_checkpoint()
        model, optimizer, scheduler = setup_model_and_optimizer(*args, **kwargs)
        megatron_args = _megatron_args()
        if megatron_args.dhelix:
            from dhelix.file_formats import FormatError
            from dhelix.options import OptionError
            from dhelix.parallel import job_of_megatron_group
            from dhelix.runtime.megatron_training import megatron_forward_backward
            from dhelix.runtime.setup import DHelixSetupError, setup_dhelix
            from megatron_patches.folded_model import FoldedGPTModel
            from megatron_patches.gpt_parts import unwrap_gpt
            from megatron_patches.run_options import current_run

            if _folded(megatron_args) and not isinstance(unwrap_gpt(model[0]), FoldedGPTModel):
                _fail("--dhelix with --pipeline-model-parallel-size > 1 builds the folded "
                      "model from the GPTModelConfig given to pretrain() (as Megatron-LM's "
                      "pretrain_gpt.py does); this script built its model another way (a "
                      "model_provider)")
            # megatron.training created the process group: DHelix's own groups (lanes) get
            # its --distributed-timeout-minutes too, so a stalled rank is found in them
            job = job_of_megatron_group(
                timedelta(minutes=megatron_args.distributed_timeout_minutes))
            try:
                # the typed run megatron_patches.run_options built after validate_args
                dhelix_setup = setup_dhelix(current_run(), model, job)
            except (DHelixSetupError, FormatError, OptionError) as exc:
                _fail(str(exc))
            _Run.setup = dhelix_setup
            _Run.forward_backward = megatron_forward_backward(dhelix_setup, megatron_args)
            if megatron_args.rank == 0:
                schedule = ("W-shaped schedule over the folded model" if _folded(megatron_args)
                            else "SI schedule")
                print(f"dhelix: {schedule}, {dhelix_setup.describe()}", flush=True)
        return model, optimizer, scheduler

    @functools.wraps(get_forward_backward_func)
    def forward_backward_func(*args, **kwargs):
        if _Run.forward_backward is not None:
            return _Run.forward_backward
        return get_forward_backward_func(*args, **kwargs)

    training.setup_model_and_optimizer = setup
    training.get_forward_backward_func = forward_backward_func


def install_training_hooks() -> None:
    """Install the hooks above into megatron.training (idempotent). Must run before the
    pretrain script imports `megatron.training` names it calls (run the script after)."""
    from megatron.core import parallel_state
    from megatron.training import arguments, checkpointing, training
    from megatron.training.models import gpt as gpt_models

    # installed once the last hook, the parser's, is (read off the patch, as
    # `cpu_shims_active` does)
    if hasattr(arguments.parse_args, "__dhelix_original__"):
        return

    from megatron_patches.argument_docstrings import cache_field_docstrings
    from megatron_patches.checkpoint_guard import install_checkpoint_guard
    from megatron_patches.compat import use_prebuilt_dataset_helpers
    from megatron_patches.nan_stop import install_nan_stop
    from megatron_patches.stall_roll_call import install_stall_roll_call

    use_prebuilt_dataset_helpers()
    cache_field_docstrings()
    install_checkpoint_guard()
    install_nan_stop()
    install_stall_roll_call()
    _hook_parallel_state(parallel_state)
    _hook_model_builder(gpt_models)
    _hook_default_layer_spec(gpt_models)
    _hook_training(training)
    from megatron_patches.run_options import hook_load_args_from_checkpoint, hook_validate_args

    hook_load_args_from_checkpoint(checkpointing)
    hook_validate_args(arguments, _fail)
    _hook_parse_args(arguments)
