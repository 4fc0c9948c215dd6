"""Linear layers (replicated, column/row tensor-parallel, fused qkv and gate_up) over ops.quant_matmul."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.checkpoint_tensor import materialize
from flashllm.ops.quant_matmul import ACTIVATION_SCHEMES, QuantizedWeight, dequantize
from flashllm.quant.spec import SMOOTH_FACTOR_SUFFIX, WEIGHT_SCALE_SUFFIX, WeightQuantSpec
from flashllm.quant.weight_only import quantize_weight

# checkpoint dtype of `<prefix>.weight` -> the scheme of a pre-quantized layer (see quant/spec.py)
PREQUANTIZED_DTYPES: dict[torch.dtype, str] = {torch.int8: "a8w8", torch.float8_e4m3fn: "fp8"}
_SCHEME_DTYPES = {scheme: dtype for dtype, scheme in PREQUANTIZED_DTYPES.items()}


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tp_size={denominator}; choose a tensor "
            "parallel size that divides it"
        )
    return numerator // denominator


def copy_checked(param: Tensor, loaded: Tensor, what: str = "weight") -> None:
    """Copy `loaded` into `param` (converting dtype and device), refusing a shape mismatch.

    loaded: a Tensor or an unread CheckpointTensor (models/checkpoint_tensor.py), read here.
    """
    _check_shape(loaded, tuple(param.shape), what)
    param.data.copy_(materialize(loaded))


def _check_shape(loaded: Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(
            f"{what} has shape {tuple(loaded.shape)} but the model expects {expected}; "
            "the checkpoint does not match its config.json"
        )


def _quantize_input_slice(weight: Tensor, quant: WeightQuantSpec, smooth: Tensor | None) -> QuantizedWeight:
    """Quantize a row-parallel rank's (N, K / tp) slice as the whole (N, K) weight would be.

    A per-output-channel scale (and zero point) comes from each row's extremes, which one rank's
    slice does not hold. The slice is quantized beside two extra columns carrying every row's
    minimum and maximum over all ranks (all-reduced), which are then dropped: each rank's codes and
    scales are those of the unsharded weight, so tensor parallelism does not change the numerics.
    """
    low = weight.amin(dim=1, keepdim=True).float()
    high = weight.amax(dim=1, keepdim=True).float()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    padded = torch.cat([weight, low.to(weight.dtype), high.to(weight.dtype)], dim=1)  # exact: weight values
    padded_smooth = None if smooth is None else torch.cat([smooth, smooth.new_ones(2)])
    q = quantize_weight(padded, quant.scheme, -1, quant.symmetric, smooth=padded_smooth)
    k = weight.shape[1]
    columns = k // 2 if quant.scheme == "w4a16" else k  # int4 codes are packed two per byte along K
    return QuantizedWeight(q.scheme, q.data[:, :columns].contiguous(), q.scales, q.zeros, q.group_size, smooth=smooth)


def default_weight_loader(param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
    """Weight loader of a parameter that is neither sharded nor fused."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not fused; got shard_id={shard_id!r}")
    copy_checked(param, loaded_weight)


def plus_one_weight_loader(param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
    """Weight loader of a norm scale stored as its offset w from 1 (Gemma's, Nemotron's): the parameter holds 1 + w,
    added in the parameter's dtype."""
    default_weight_loader(param, loaded_weight, shard_id)
    param.data.add_(1.0)


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


def checkpoint_param(model: nn.Module, param_name: str) -> nn.Parameter | None:
    """The parameter a pre-quantized checkpoint's extra tensor loads into, created on first use.

    param_name: `<linear prefix>.weight_scale` or `<linear prefix>.smooth_factor` (see
    quant/spec.py); None for any other name or when the prefix is not a linear layer. Models'
    load_weights call this for names that match no parameter.
    """
    prefix, _, attr = param_name.rpartition(".")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    return module.checkpoint_param(attr) if isinstance(module, LinearBase) else None


class LinearBase(nn.Module):
    """y = x @ W.T + b through `ops.quant_matmul`; W (output_size_per_partition, input_size_per_partition).

    Subclasses decide how a checkpoint tensor maps onto this rank's slice (`weight_loader`).
    `process_weights_after_loading()` must run once after loading: it builds the QuantizedWeight
    the forward passes to the op, which is where weight quantization plugs in. A pre-quantized
    checkpoint (int8 / e4m3 weight + weight_scale [+ smooth_factor], quant/spec.py) is copied
    into the float `weight` exactly (every int8 and e4m3 value is a float32/16 and bf16 value)
    and turned back into its codes there, without requantizing.
    """

    # row-parallel layers split the input features across ranks (weight columns, smooth_factor)
    input_is_sharded: ClassVar[bool] = False

    def __init__(
        self,
        input_size_per_partition: int,
        output_size_per_partition: int,
        bias: bool,
        ops: Any,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self._quant_matmul = ops.quant_matmul
        shape = (output_size_per_partition, input_size_per_partition)
        self.weight = _new_param(shape, dtype, device, self._load_weight)
        self.bias = _new_param((output_size_per_partition,), dtype, device, self.weight_loader) if bias else None
        # created by checkpoint_param() only when a pre-quantized checkpoint carries them
        self.register_parameter("weight_scale", None)
        self.register_parameter("smooth_factor", None)
        self._stored_schemes: set[str] = set()
        self.qweight: QuantizedWeight | None = None

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """Where checkpoint projection `shard_id` lands in this rank's output features.

        Returns (offset in this rank's output features, first checkpoint row this rank holds,
        rows it holds, rows of the checkpoint tensor). Raises ValueError for an unknown shard_id.
        A layer held whole on every rank: (0, 0, N, N); subclasses split or fuse.
        """
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        n = self.output_size_per_partition
        return 0, 0, n, n

    def input_shard(self) -> tuple[int, int, int]:
        """(first checkpoint input feature this rank holds, how many, the checkpoint's in_features)."""
        k = self.input_size_per_partition
        return 0, k, k

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Copy this rank's part of a checkpoint weight (N, K), bias (N,) or weight_scale (N, 1) into `param`.

        The part is cut by output_shard / input_shard (K only for the weight) before anything is
        read, so a rank reads its shard only; the checkpoint tensor's whole shape is checked first.
        """
        offset, start, rows, full_rows = self.output_shard(shard_id)
        target = param.narrow(0, offset, rows)
        expected = [full_rows, *target.shape[1:]]
        k_start, k_size, k_full = self.input_shard()
        if param is self.weight:
            expected[1] = k_full
        what = f"shard {shard_id}" if shard_id is not None else "weight"
        _check_shape(loaded_weight, tuple(expected), what)
        loaded_weight = loaded_weight.narrow(0, start, rows)
        if param is self.weight:
            loaded_weight = loaded_weight.narrow(1, k_start, k_size)
        copy_checked(target, loaded_weight, what)

    def _load_weight(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """The weight's loader: notes whether the checkpoint stores it pre-quantized, then copies it."""
        self._stored_schemes.add(PREQUANTIZED_DTYPES.get(loaded_weight.dtype, "none"))
        if len(self._stored_schemes) > 1:
            raise ValueError(f"the shards of this fused weight mix storage formats {sorted(self._stored_schemes)}; "
                             "quantize every projection of the layer the same way")
        self.weight_loader(param, loaded_weight, shard_id)

    def checkpoint_param(self, attr: str) -> nn.Parameter | None:
        """`weight_scale` (N, 1) / `smooth_factor` (K,) fp32 parameters of this rank, made on first use."""
        if self.weight is None:  # already quantized, or holding a GPTQ/AWQ layer's packed tensors
            return None
        device = self.weight.device
        if attr == WEIGHT_SCALE_SUFFIX:
            if self.weight_scale is None:
                shape = (self.output_size_per_partition, 1)
                self.weight_scale = _new_param(shape, torch.float32, device, self._load_weight_scale)
            return self.weight_scale
        if attr == SMOOTH_FACTOR_SUFFIX:
            if self.smooth_factor is None:
                shape = (self.input_size_per_partition,)
                self.smooth_factor = _new_param(shape, torch.float32, device, self._load_smooth_factor)
                self._smooth_loaded = False
            return self.smooth_factor
        return None

    def _load_weight_scale(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Per-channel scales (N,) or (N, 1) slice like the weight's rows."""
        if loaded_weight.dim() == 1:  # load (N,) into the (N,) view of the parameter: nothing is read yet
            self.weight_loader(param.data.view(-1), loaded_weight, shard_id)
            return
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != 1:
            raise ValueError(f"weight_scale must be per output channel, (N, 1) or (N,); got {tuple(loaded_weight.shape)}")
        self.weight_loader(param, loaded_weight, shard_id)

    def _load_smooth_factor(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """(K,) factors of the input; every shard of a fused layer must bring the same ones."""
        if loaded_weight.dim() == 1:
            start, size, full = self.input_shard()
            _check_shape(loaded_weight, (full,), "smooth_factor")
            loaded_weight = loaded_weight.narrow(0, start, size)
        loaded_weight = materialize(loaded_weight)
        if self._smooth_loaded and not torch.equal(param.data, loaded_weight.to(param.dtype)):
            raise ValueError("the fused projections read one input, so their smooth_factor tensors must be "
                             "identical; re-export the checkpoint with one factor per input")
        copy_checked(param, loaded_weight, "smooth_factor")
        self._smooth_loaded = True

    def process_weights_after_loading(self, quant: WeightQuantSpec | None = None) -> None:
        """Build the QuantizedWeight the forward multiplies by from the loaded weight.

        With an enabled `quant` spec the weight is quantized (see flashllm.quant.quantize_weight)
        and the float parameter is dropped, so only the quantized copy stays in memory. A
        pre-quantized checkpoint of the same scheme keeps its codes; of another scheme it is
        dequantized first (and its smooth factors divided out unless the scheme takes them).
        """
        scheme = quant.scheme if quant is not None and quant.enabled else "none"
        try:
            stored = self._stored_scheme()
            if stored != "none" and stored == scheme:
                self.qweight = self._prequantized(stored)
            else:
                self.qweight = self._quantize(self._float_weight(stored, keep_smooth=scheme in ACTIVATION_SCHEMES),
                                              quant)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__} {tuple(self.weight.shape)}: {err}") from None
        if scheme != "none":
            self.weight = None
        self.weight_scale = None
        self.smooth_factor = None

    def _stored_scheme(self) -> str:
        stored = next(iter(self._stored_schemes), "none")
        if stored != "none" and self.weight_scale is None:
            raise ValueError(f"the checkpoint stores this weight as {_SCHEME_DTYPES[stored]} codes but has no "
                             f"{WEIGHT_SCALE_SUFFIX} tensor beside it; the pre-quantized checkpoint is incomplete")
        if stored == "none" and self.weight_scale is not None:
            raise ValueError(f"the checkpoint has a {WEIGHT_SCALE_SUFFIX} for a float weight; pre-quantized "
                             "weights are int8 (a8w8) or float8_e4m3fn (fp8)")
        return stored

    def _smooth(self) -> Tensor | None:
        return None if self.smooth_factor is None else self.smooth_factor.data

    def _prequantized(self, scheme: str) -> QuantizedWeight:
        data = self.weight.data.to(_SCHEME_DTYPES[scheme])  # exact: the values were codes
        return QuantizedWeight(scheme, data, self.weight_scale.data.clone(), smooth=self._smooth())

    def _float_weight(self, stored: str, keep_smooth: bool) -> Tensor:
        """The loaded weight as floats: dequantized when stored pre-quantized, unsmoothed unless kept."""
        weight = self.weight.data
        if stored != "none":
            weight = dequantize(self._prequantized(stored))
        smooth = self._smooth()
        if smooth is not None and not keep_smooth:
            weight = weight.to(torch.float32) / smooth
        return weight

    def _quantize(self, weight: Tensor, quant: WeightQuantSpec | None) -> QuantizedWeight:
        if quant is None or not quant.enabled:
            if weight.data_ptr() != self.weight.data_ptr():  # dequantized or unsmoothed: store it in place
                self.weight.data.copy_(weight)
            return QuantizedWeight.dense(self.weight)
        smooth = self._smooth() if quant.scheme in ACTIVATION_SCHEMES else None
        if self.input_is_sharded and self.tp_size > 1 and quant.group_size == -1:
            return _quantize_input_slice(weight, quant, smooth)
        return quantize_weight(weight, quant.scheme, quant.group_size, quant.symmetric, smooth=smooth)

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.qweight is None:
            raise RuntimeError(
                f"{type(self).__name__} used before process_weights_after_loading(); load the "
                "model with flashllm.models.loader.load_model"
            )
        return self._quant_matmul(x, self.qweight, bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (T, input_size_per_partition) -> (T, output_size_per_partition) in x.dtype."""
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(input_size, output_size, bias, ops, dtype, device, tp_rank, tp_size)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r*N/tp, (r+1)*N/tp) of W and b."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        out = _divide(output_size, tp_size, "output_size")
        super().__init__(input_size, out, bias, ops, dtype, device, tp_rank, tp_size)

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """(0, rank * N/tp, N/tp, N): see LinearBase.output_shard."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        n = self.output_size_per_partition
        return 0, self.tp_rank * n, n, n * self.tp_size


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    The bias is held whole by every rank and added once, after the reduction.
    """

    input_is_sharded: ClassVar[bool] = True

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        inp = _divide(input_size, tp_size, "input_size")
        super().__init__(inp, output_size, bias, ops, dtype, device, tp_rank, tp_size)

    def input_shard(self) -> tuple[int, int, int]:
        """(rank * K/tp, K/tp, K); the bias and weight_scale stay whole on every rank."""
        k = self.input_size_per_partition
        return self.tp_rank * k, k, k * self.tp_size

    def forward(self, x: Tensor) -> Tensor:
        """x (T, input_size / tp) -> (T, output_size), summed over ranks."""
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        out = self._matmul(x, None)
        torch.distributed.all_reduce(out)
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate_up_proj).

    Checkpoint shard `shard_id` (an index into `output_sizes`) lands at its offset in this rank's
    slice, so the output is [shard0 | shard1 | ...] per rank.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = [_divide(n, tp_size, "output_size") for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, ops, dtype, device, tp_rank, tp_size)

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """Projection `shard_id` (0..n-1): its rank slice lands after the earlier projections' slices."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnParallelLinear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), self.tp_rank * size, size, size * self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused: output [q (Hq*D) | k (Hk*D) | v (Hk*D)] per rank.

    Query heads are split across ranks; key/value heads too, or replicated when there are fewer
    of them than ranks (rank r then holds kv head r * Hk // tp).
    """

    _SHARD_INDEX = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim, self.total_num_kv_heads = head_dim, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        else:
            _divide(tp_size, total_num_kv_heads, "tp_size (replicating kv heads)")
            self.num_kv_heads = 1
        if tp_size > total_num_kv_heads:
            # tp_size // Hk consecutive ranks share one kv head
            self._kv_head_start = tp_rank * total_num_kv_heads // tp_size
        else:
            self._kv_head_start = tp_rank * self.num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, ops, dtype, device, tp_rank, tp_size)

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """q: this rank's query heads; k, v: its kv heads (a replica when kv heads are fewer than ranks)."""
        index = self._SHARD_INDEX.get(shard_id, shard_id) if isinstance(shard_id, str) else shard_id
        if index not in (0, 1, 2):
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k', 'v' (or 0-2), got {shard_id!r}")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if index == 0:
            return 0, self.tp_rank * q_size, q_size, q_size * self.tp_size
        offset = q_size if index == 1 else q_size + kv_size
        return offset, self._kv_head_start * self.head_dim, kv_size, self.total_num_kv_heads * self.head_dim
