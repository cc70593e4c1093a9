"""Symbolic description of one dense transformer layer: everything the operator programs
depend on (sizes, variants, parallel layout, node topology), without building a model.

`LayerDescription` is what `dhelix ops` and the planner use to get a layer's DAGs without
launching ranks, and what the runtime re-derives from a live megatron-core layer before it
binds the same programs to that layer's modules. Unsupported configurations raise
`UnsupportedLayerError` here, once, with a sentence naming the setting and the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from dhelix.ops.moe_describe import MoEDescription, check_supported_moe, moe_layer_pattern
from dhelix.options import ATTENTION_CHOICES
from dhelix.topology import NodeTopology, expert_parallel_ranks, tensor_parallel_ranks

DROPOUT_POLICY = (
    "dhelix operator programs support dropout 0 only (the Llama/GPT-NeoX setting); set "
    "--hidden-dropout 0 --attention-dropout 0. With dropout > 0 the two strands would draw "
    "dropout masks from the shared RNG in an interleaved order, so results could not equal "
    "Megatron's; see docs/operator_programs.md"
)


class UnsupportedLayerError(ValueError):
    """The layer or configuration is outside what the operator programs implement."""


_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def dtype_name(dtype) -> str:
    """'float32' / 'bfloat16' / 'float16' for a torch dtype (or the string itself)."""
    text = str(dtype)
    return _DTYPE_NAMES.get(text, text.replace("torch.", ""))


def _activation_name(func) -> str:
    name = getattr(func, "__name__", type(func).__name__)
    return {"gelu": "gelu", "silu": "silu"}.get(name, name)


@dataclass(frozen=True)
class LayerDescription:
    """A dense GPT/Llama transformer layer on one rank of its tensor-parallel group.

    Sizes are global (unsharded) Megatron sizes; `seq_length` is the full sequence length
    (each rank holds seq_length / tp tokens between the collectives when SP is on).
    `tp_ranks` is the tensor-parallel group (global ranks) and decides, with `topology`,
    whether its collectives use the intra- or inter-node channel.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    micro_batch_size: int
    tp_size: int = 1
    sequence_parallel: bool = False
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: Optional[bool] = None  # None: same as add_bias_linear (Megatron's rule)
    rope: bool = False
    causal: bool = True
    attention: str = "megatron"  # core attention: "megatron" (DotProductAttention) or "sdpa"
    dtype: str = "float32"
    tp_ranks: tuple = ()
    topology: NodeTopology = field(default_factory=NodeTopology)
    # the MoE MLP (router, experts, expert parallelism) of an MoE layer; None: a dense MLP
    moe: Optional[MoEDescription] = None

    def __post_init__(self):
        if self.add_qkv_bias is None:
            object.__setattr__(self, "add_qkv_bias", self.add_bias_linear)
        if not self.tp_ranks:
            object.__setattr__(self, "tp_ranks", tuple(tensor_parallel_ranks(self.tp_size)))
        object.__setattr__(self, "tp_ranks", tuple(self.tp_ranks))
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise UnsupportedLayerError for sizes the programs cannot shard."""
        tp = self.tp_size
        if tp < 1 or len(self.tp_ranks) != tp:
            raise UnsupportedLayerError(
                f"tensor-parallel size {tp} does not match its group ranks {self.tp_ranks}"
            )
        if self.sequence_parallel and tp == 1:
            raise UnsupportedLayerError("sequence parallelism needs tensor-parallel size > 1")
        if self.num_attention_heads % tp or self.ffn_hidden_size % tp:
            raise UnsupportedLayerError(
                f"attention heads ({self.num_attention_heads}) and ffn hidden size "
                f"({self.ffn_hidden_size}) must be divisible by tensor-parallel size {tp}"
            )
        if self.num_query_groups % tp or self.num_attention_heads % self.num_query_groups:
            raise UnsupportedLayerError(
                f"num_query_groups {self.num_query_groups} must divide the "
                f"{self.num_attention_heads} heads and be a multiple of tensor-parallel size "
                f"{tp} (fewer KV groups than TP ranks needs Megatron's hidden QKV all-gather, "
                "which the operator programs do not model)"
            )
        if self.sequence_parallel and self.seq_length % tp:
            raise UnsupportedLayerError(
                f"sequence length {self.seq_length} is not divisible by tensor-parallel size "
                f"{tp}, which sequence parallelism needs"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise UnsupportedLayerError(f"normalization {self.normalization!r} is not supported")
        if self.attention not in ATTENTION_CHOICES:
            raise UnsupportedLayerError(f"core attention {self.attention!r} is not one of "
                                        f"{', '.join(ATTENTION_CHOICES)}")
        if self.moe is not None and self.moe.problems():
            raise UnsupportedLayerError("; ".join(self.moe.problems()))
        if self.moe is not None and tp != 1 and not self.sequence_parallel:
            raise UnsupportedLayerError(
                f"MoE layers with tensor-parallel size {tp} run as operators with sequence "
                "parallelism only (Megatron's MoE layer refuses to train without it); add "
                "--sequence-parallel")

    # ------------------------------------------------------------- derived sizes
    @property
    def tokens_local(self) -> int:
        """Tokens per rank outside the tensor-parallel region (s/tp * b with SP)."""
        s = self.seq_length // self.tp_size if self.sequence_parallel else self.seq_length
        return s * self.micro_batch_size

    @property
    def tokens(self) -> int:
        """Tokens inside the tensor-parallel region (the full sequence times the batch)."""
        return self.seq_length * self.micro_batch_size

    @property
    def local_seq(self) -> int:
        return self.seq_length // self.tp_size if self.sequence_parallel else self.seq_length

    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def groups_per_rank(self) -> int:
        return self.num_query_groups // self.tp_size

    @property
    def qkv_out_per_rank(self) -> int:
        return (self.heads_per_rank + 2 * self.groups_per_rank) * self.kv_channels

    @property
    def proj_in_per_rank(self) -> int:
        return self.heads_per_rank * self.kv_channels

    @property
    def fc1_out_per_rank(self) -> int:
        width = self.ffn_hidden_size // self.tp_size
        return 2 * width if self.gated_linear_unit else width

    @property
    def ffn_per_rank(self) -> int:
        return self.ffn_hidden_size // self.tp_size

    @property
    def tp_channel(self) -> str:
        return self.topology.channel_for_group(self.tp_ranks)

    @property
    def ep_channel(self) -> str:
        """The channel of the MoE all-to-alls: 'inter' when the expert-parallel group spans
        nodes."""
        if self.moe is None:
            raise ValueError("a dense layer has no expert-parallel group")
        return self.topology.channel_for_group(self.moe.ep_ranks)

    @property
    def attention_kernel(self) -> str:
        """Cost-key name of the attention region: its core attention differs in cost."""
        return "sdpa_attention" if self.attention == "sdpa" else "attention"

    @property
    def activation_kernel(self) -> str:
        if self.gated_linear_unit:
            return {"silu": "swiglu", "gelu": "geglu"}.get(self.activation, f"glu_{self.activation}")
        return self.activation

    def summary(self) -> str:
        parts = [
            f"h={self.hidden_size}", f"ffn={self.ffn_hidden_size}",
            f"heads={self.num_attention_heads}", f"groups={self.num_query_groups}",
            f"s={self.seq_length}", f"b={self.micro_batch_size}", f"tp={self.tp_size}",
            "sp" if self.sequence_parallel else "no-sp", self.normalization,
            self.activation_kernel, "bias" if self.add_bias_linear else "no-bias",
            "rope" if self.rope else "abs-pos", f"{self.attention} attention", self.dtype,
            f"tp-group {list(self.tp_ranks)} on {self.tp_channel} ({self.topology.describe()})",
        ]
        if self.moe is not None:
            parts.append(f"{self.moe.summary()} on {self.ep_channel}")
        return ", ".join(parts)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_config(cls, config, seq_length: int, micro_batch_size: int, *, rope: bool,
                    tp_ranks: Optional[Sequence[int]] = None,
                    topology: Optional[NodeTopology] = None,
                    attention: str = "megatron", moe: bool = False,
                    ep_ranks: Optional[Sequence[int]] = None) -> "LayerDescription":
        """Description of a layer built from a megatron-core TransformerConfig (its core
        attention `attention`, which the config does not record); `moe`: the layer's MLP is
        the config's MoE layer, its expert-parallel group `ep_ranks` (default: Megatron's
        layout for rank 0).

        Raises UnsupportedLayerError for configurations the programs do not implement.
        """
        check_supported_config(config)
        tp = config.tensor_model_parallel_size
        moe_desc = None
        if moe:
            ep = config.expert_model_parallel_size
            moe_desc = MoEDescription.from_config(
                config, tuple(ep_ranks) if ep_ranks is not None
                else tuple(expert_parallel_ranks(ep)))
        return cls(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            tp_size=tp,
            sequence_parallel=bool(config.sequence_parallel),
            normalization=config.normalization,
            activation=_activation_name(config.activation_func),
            gated_linear_unit=bool(config.gated_linear_unit),
            add_bias_linear=bool(config.add_bias_linear),
            add_qkv_bias=bool(config.add_bias_linear or config.add_qkv_bias),
            rope=rope,
            attention=attention,
            dtype=dtype_name(config.params_dtype),
            tp_ranks=tuple(tp_ranks) if tp_ranks is not None else tuple(tensor_parallel_ranks(tp)),
            topology=topology or NodeTopology.detect(),
            moe=moe_desc,
        )

    @classmethod
    def from_args(cls, args, topology: Optional[NodeTopology] = None,
                  rank: int = 0, layer: int = 0) -> "LayerDescription":
        """Description of decoder layer `layer` (0-based; MoE or dense as `--moe-layer-freq`
        says) from Megatron's validated arguments
        (`megatron_patches.parsed_arguments.parse_megatron_args`, or `get_args()` in a
        run): the TransformerConfig `pretrain()` builds from them
        (`core_transformer_config_from_args`), so both agree on every
        derived size; the core attention `--dhelix-attention` selects."""
        from megatron.training.argument_utils import core_transformer_config_from_args

        config = core_transformer_config_from_args(args)
        pattern = moe_layer_pattern(config)
        if not 0 <= layer < len(pattern):
            raise UnsupportedLayerError(f"layer {layer} is outside the model's "
                                        f"{len(pattern)} layers")
        tp = args.tensor_model_parallel_size
        return cls.from_config(
            config, args.seq_length, args.micro_batch_size,
            rope=args.position_embedding_type == "rope",
            tp_ranks=tensor_parallel_ranks(tp, rank),
            topology=topology, attention=args.dhelix_attention, moe=bool(pattern[layer]),
            ep_ranks=expert_parallel_ranks(config.expert_model_parallel_size, rank),
        )


def check_supported_config(config) -> None:
    """Raise UnsupportedLayerError when `config` asks for something the operator programs
    do not implement (each message names the setting and what to do)."""
    problems = []
    if getattr(config, "num_moe_experts", None):
        problems.extend(check_supported_moe(config))
    if getattr(config, "context_parallel_size", 1) != 1:
        problems.append("context parallelism is not supported yet (ring KV send/recv "
                        "operators are planned); use --context-parallel-size 1")
    if config.hidden_dropout or config.attention_dropout:
        problems.append(DROPOUT_POLICY)
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        problems.append("fp8/fp4 training is not supported by the operator programs")
    if getattr(config, "recompute_granularity", None):
        problems.append("activation recomputation is not supported; drop --recompute-*")
    if getattr(config, "multi_latent_attention", False):
        problems.append("multi-latent attention is not supported")
    if getattr(config, "attention_output_gate", False):
        problems.append("attention output gates are not supported")
    if getattr(config, "delay_wgrad_compute", False):
        problems.append("delay_wgrad_compute is Megatron's own wgrad deferral; the operator "
                        "programs already split wgrad GEMMs, so turn it off")
    if getattr(config, "cpu_offloading", False):
        problems.append("CPU activation offloading is not supported")
    if getattr(config, "transformer_impl", "local") == "inference_optimized":
        problems.append("the inference-optimized layer is not supported")
    tp = config.tensor_model_parallel_size
    groups = config.num_query_groups or config.num_attention_heads
    if groups % tp:
        problems.append(f"num_query_groups {groups} smaller than (or not a multiple of) "
                        f"tensor-parallel size {tp} is not supported")
    if problems:
        raise UnsupportedLayerError("; ".join(problems))
