"""What the recorder knows about aten ops before running them: which ops overwrite, leave
uninitialized memory, only move values, are pointwise or draw random numbers, and what an
overload's schema says (``op_info``), computed once per overload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nondet.fingerprint import name_code
from nondet.frameworks.torch import comm
from nondet.records import Flag

#: In-place ops whose result does not depend on the old value of the tensor they write.
OVERWRITE_OPS = frozenset(
    {
        "fill_", "zero_", "copy_", "set_", "uniform_", "normal_", "random_", "bernoulli_",
        "exponential_", "geometric_", "cauchy_", "log_normal_", "_foreach_zero_",
        "_foreach_copy_", "detach_", "resize_", "resize_as_",
    }
)
#: Ops whose output is uninitialized memory (see Note [Uninitialized memory]).
UNINIT_OPS = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "empty_permuted", "resize_", "resize_as_", "_empty_affine_quantized",
        "_empty_per_channel_affine_quantized",
    }
)
#: Ops that only move values: a copy of uninitialized memory is uninitialized memory.
MOVE_OPS = frozenset({"copy_", "clone", "_to_copy"})
#: Elementwise ops without reductions: bitwise deterministic functions of their inputs on
#: every device (Note [Derived fingerprints]). Deliberately short; anything else is hashed.
POINTWISE_OPS = frozenset(
    {
        "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "neg_", "abs",
        "abs_", "relu", "relu_", "threshold_backward", "clamp", "clamp_", "clamp_min",
        "clamp_min_", "clamp_max", "clamp_max_", "where", "maximum", "minimum", "fill_",
        "zero_", "copy_", "clone", "_to_copy", "ones_like", "zeros_like", "full_like",
        "lerp", "lerp_", "addcmul", "addcmul_", "addcdiv", "addcdiv_", "sqrt", "sqrt_",
        "rsqrt", "rsqrt_", "reciprocal", "reciprocal_", "sign", "square", "pow", "pow_",
        "exp", "exp_", "log", "log_", "tanh", "tanh_", "tanh_backward", "sigmoid",
        "sigmoid_", "sigmoid_backward", "gelu", "gelu_backward", "silu", "silu_backward",
        "leaky_relu", "leaky_relu_backward", "hardtanh", "hardtanh_backward", "elu",
        "elu_backward", "softplus", "softplus_backward", "eq", "ne", "lt", "le", "gt", "ge",
        "logical_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or", "masked_fill",
        "masked_fill_", "sin", "cos", "erf", "floor", "ceil", "round", "trunc", "frac",
    }
)
#: Ops that draw from a random number generator.
RNG_OPS = frozenset(
    {
        "uniform_", "normal_", "normal", "bernoulli_", "bernoulli", "random_", "exponential_",
        "geometric_", "cauchy_", "log_normal_", "native_dropout", "dropout", "feature_dropout",
        "alpha_dropout", "randperm", "randint", "randint_like", "rand", "rand_like", "randn",
        "randn_like", "multinomial", "poisson", "binomial", "_standard_gamma",
        "_sample_dirichlet", "rrelu_with_noise", "_fused_dropout",
    }
)
#: Auxiliary outputs that real kernels leave uninitialized or fill with bookkeeping, by op
#: and position in the schema's returns: never hashed nor compared. Flash and
#: memory-efficient attention return their philox seed/offset (``rng_state``/``unused``)
#: as ``empty`` when dropout_p == 0 and a debug mask that is ``empty`` unless asked for;
#: cuDNN/MIOpen RNNs return a reserve buffer (workspace for backward, padding included).
#: A seed that matters (dropout_p > 0) comes from the generator, whose state is compared at
#: every step, and its effect shows in the op's output anyway.
AUX_OUTPUTS: dict[str, tuple[int, ...]] = {
    "_scaled_dot_product_flash_attention": (6, 7, 8),
    "_scaled_dot_product_cudnn_attention": (6, 7, 8),
    "_scaled_dot_product_fused_attention_overrideable": (6, 7, 8),
    "_scaled_dot_product_efficient_attention": (2, 3),
    "_flash_attention_forward": (2, 3, 4),
    "_efficient_attention_forward": (2, 3),
    "_cudnn_rnn": (3,),
    "miopen_rnn": (3,),
}

#: Outputs that are a buffer argument returned after the op wrote only a part of it (the
#: schema declares no alias), by op and position: remembered as uninitialized memory, never
#: hashed. FSDP2's ``fsdp::all_gather_copy_in`` copies its rank's shard into the
#: ``torch.empty`` all-gather output and returns that whole buffer; the other ranks' parts
#: hold garbage until the all-gather fills them (hashed, it "differed" in every 2-rank run).
#: The CPU CTC loss returns its ``log_alpha`` table (kept for the backward) written only up
#: to each sequence's input and target lengths: the rest is whatever the allocator held
#: (its record "differed" with equal inputs, and was blamed ahead of an unseeded NumPy draw
#: that changed the loss, PyTorch round 14).
PARTLY_WRITTEN: dict[str, tuple[int, ...]] = {
    "all_gather_copy_in": (1,),
    "_ctc_loss": (1,),
}


def aux_tensors(out: Any, positions: tuple[int, ...]) -> list[Any]:
    """The auxiliary outputs at ``positions`` of an op's return value (AUX_OUTPUTS)."""
    if not isinstance(out, (tuple, list)):
        return []
    return [out[i] for i in positions if i < len(out) and hasattr(out[i], "device")]


@dataclass(frozen=True)
class OpInfo:
    """What the schema says about an op, computed once per overload."""

    name_id: int
    view: bool  # returns an alias of an input and writes nothing
    mutated_args: frozenset[int]
    mutated_kwargs: frozenset[str]
    overwritten_args: frozenset[int]  # mutated args whose old value cannot matter
    overwritten_kwargs: frozenset[str]
    uninit_output: bool
    flags: int
    from_storage: bool = False  # set_(storage): the values come from outside the ops
    storage_handle: bool = False  # set_(storage) without geometry: all of its bytes
    move: bool = False  # only moves values (MOVE_OPS)
    pointwise: bool = False  # output derived from inputs (Note [Derived fingerprints])
    code: int = 0  # stable code of the op name
    aux: tuple[int, ...] = ()  # positions of outputs never hashed nor compared (AUX_OUTPUTS)
    comm: bool = False  # a torch.distributed collective (comm.py): phase comm, outputs later
    #: its outputs are hashed (not derived, uninitialized or wrapped), so a difference there
    #: can be measured from kept copies
    measured: bool = True
    partly_written: tuple[int, ...] = ()  # outputs left uninitialized (PARTLY_WRITTEN)
    #: where its ``accumulate`` argument is (position, name), if it has one (Flag.ACCUMULATES)
    accumulate: tuple[int, str] | None = None



def op_info(func: Any, name_id: int) -> OpInfo:
    """What an op overload's schema says, for the recorder (``name_id``: its interned name)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return OpInfo(name_id, False, frozenset(), frozenset(), frozenset(), frozenset(),
                      False, 0)
    base = schema.name.split("::")[-1]
    mutated_args, mutated_kwargs, over_args, over_kwargs = set(), set(), set(), set()
    positional = 0
    accumulate = None
    for arg in schema.arguments:
        written = arg.alias_info is not None and arg.alias_info.is_write
        if arg.name == "accumulate" and str(arg.type) == "bool":
            accumulate = (-1 if arg.kwarg_only else positional, arg.name)
        if arg.kwarg_only:
            if written:
                mutated_kwargs.add(arg.name)
                over_kwargs.add(arg.name)  # out= arguments are written whole
        else:
            if written:
                mutated_args.add(positional)
                if base in OVERWRITE_OPS:
                    over_args.add(positional)
            positional += 1
    writes = bool(mutated_args or mutated_kwargs)
    view = not writes and any(r.alias_info is not None for r in schema.returns)
    flags = (Flag.RNG if base in RNG_OPS else 0) | (Flag.INPLACE if writes else 0)
    uninit = base in UNINIT_OPS
    if uninit:
        flags |= Flag.UNINIT_OUTPUT
    from_storage = base == "set_" and any(
        str(arg.type) == "Storage" for arg in schema.arguments)
    handle = from_storage and len(schema.arguments) == 2  # set_.source_Storage
    pointwise = base in POINTWISE_OPS and not uninit and not (flags & Flag.RNG)
    return OpInfo(name_id, view, frozenset(mutated_args), frozenset(mutated_kwargs),
                  frozenset(over_args), frozenset(over_kwargs), uninit, int(flags),
                  from_storage, handle, base in MOVE_OPS, pointwise, name_code(str(func)),
                  AUX_OUTPUTS.get(base, ()), comm.is_comm(func),
                  not (pointwise or uninit or from_storage), PARTLY_WRITTEN.get(base, ()),
                  accumulate)


def accumulates(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The op was called with accumulate=True (its schema's default is False)."""
    assert info.accumulate is not None
    position, name = info.accumulate
    value = args[position] if 0 <= position < len(args) else kwargs.get(name, False)
    return value is True

