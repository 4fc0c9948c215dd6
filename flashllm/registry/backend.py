"""Backend, Kernel, Caps and DeviceAdapter: what a device backend declares to the registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from flashllm.ops import OpSpec, op_specs
from flashllm.registry.precision import DeviceProfile

ANY_DEVICE = "*"

# How a backend's claims are proven. A backend declares one level for all its cells; third-party
# backends that do not say are "mapped": claimed from documentation, never executed here.
PROOF_LEVELS: dict[str, str] = {
    "conformance": "kernels run and checked against the reference on real execution in CI",
    "interpreter": "kernels checked against the reference under an interpreter (TRITON_INTERPRET=1 on CPU)",
    "gpu": "kernels checked against the reference on the real accelerator",
    "mapped": "ops mapped to the vendor's documented calls; not run on the hardware",
}
DEFAULT_PROOF = "mapped"


class KernelSignatureError(TypeError):
    """A kernel's signature does not match its op spec."""


@dataclass(frozen=True, slots=True)
class Caps:
    """What one kernel can run. `None` for head_sizes / block_sizes means "any".

    alibi: the kernel adds ALiBi biases (paged_attention's `alibi_slopes`); a kernel that does not
    say so is never bound for a model whose attention uses them (the reference runs instead).
    softcap: the kernel caps attention scores (paged_attention's `logit_softcap`), likewise.
    sinks: the kernel adds per-head attention sinks to the softmax (paged_attention's `sinks`), likewise.
    moe_activations: the expert activations a fused_moe kernel runs ("silu"; "swigluoai" also means the
    experts' biases, gpt-oss), likewise.
    """

    dtypes: frozenset[torch.dtype]
    kv_dtypes: frozenset[torch.dtype] = frozenset()
    quant: frozenset[str] = frozenset({"none"})
    head_sizes: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    graph_safe: bool = True
    alibi: bool = False
    softcap: bool = False
    sinks: bool = False
    moe_activations: frozenset[str] = frozenset({"silu"})


@dataclass(frozen=True, slots=True)
class OpRequest:
    """What the engine needs from one op: the activation dtype plus the fields the op uses.

    alibi: the model's attention adds ALiBi biases (Baichuan-13B), so attention kernels must claim them.
    softcap: the model caps its attention scores (Gemma 2), so attention kernels must claim that.
    sinks: the model's attention has per-head sinks (gpt-oss), likewise.
    moe_activation: the activation (and, for "swigluoai", biases) of the model's experts, which fused_moe
    kernels must claim in Caps.moe_activations.
    """

    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None
    quant: str = "none"
    head_size: int | None = None
    block_size: int | None = None
    alibi: bool = False
    softcap: bool = False
    sinks: bool = False
    moe_activation: str = "silu"


@dataclass(frozen=True, slots=True)
class Kernel:
    """A backend's implementation of one op, with the caps it claims."""

    op: str
    fn: Callable[..., Any]
    caps: Caps
    backend: str

    def mismatch(self, request: OpRequest, uses: frozenset[str]) -> str | None:
        """Why this kernel cannot serve `request`, or None when it can.

        Only the request fields the op declares in `uses` are compared, besides the dtype.
        """
        caps = self.caps
        if request.dtype not in caps.dtypes:
            return f"dtype {_dtype_name(request.dtype)} not in {_names(caps.dtypes)}"
        if "kv_dtype" in uses and request.kv_dtype is not None and request.kv_dtype not in caps.kv_dtypes:
            return f"kv dtype {_dtype_name(request.kv_dtype)} not in {_names(caps.kv_dtypes)}"
        if "quant" in uses and request.quant not in caps.quant:
            return f"quant {request.quant!r} not in {sorted(caps.quant)}"
        if "head_size" in uses and not _allowed(request.head_size, caps.head_sizes):
            return f"head size {request.head_size} not in {sorted(caps.head_sizes or ())}"
        if "block_size" in uses and not _allowed(request.block_size, caps.block_sizes):
            return f"block size {request.block_size} not in {sorted(caps.block_sizes or ())}"
        if "alibi" in uses and request.alibi and not caps.alibi:
            return "the model uses ALiBi (alibi_slopes), which this kernel does not implement"
        if "softcap" in uses and request.softcap and not caps.softcap:
            return "the model caps attention scores (logit_softcap), which this kernel does not implement"
        if "sinks" in uses and request.sinks and not caps.sinks:
            return "the model's attention has sinks (sinks), which this kernel does not implement"
        if "moe_activation" in uses and request.moe_activation not in caps.moe_activations:
            return f"expert activation {request.moe_activation!r} not in {sorted(caps.moe_activations)}"
        return None


@dataclass(frozen=True, slots=True)
class ShapeBuckets:
    """Sizes a static-shape device pads every batch up to, so one compiled graph serves many steps.

    A graph compiler (XLA) compiles once per distinct set of input shapes. The model runner rounds
    the token count T, the number of sequences B and the block-table width up to the next power
    of two, at least these minimums: a decode reuses one graph until B or a context crosses a
    bucket edge, and the number of graphs grows with log2 of the largest sizes. Padded tokens
    write no KV (slot -1) and padded sequences have no tokens; neither is sampled.
    """

    min_tokens: int = 16
    min_seqs: int = 8
    min_blocks: int = 4

    def __post_init__(self) -> None:
        for name in ("min_tokens", "min_seqs", "min_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"ShapeBuckets.{name} must be >= 1, got {getattr(self, name)}")

    def tokens(self, n: int) -> int:
        """Padded token count for n scheduled tokens."""
        return next_bucket(n, self.min_tokens)

    def seqs(self, n: int) -> int:
        """Padded number of sequences (and of logits rows) for n sequences."""
        return next_bucket(n, self.min_seqs)

    def blocks(self, n: int) -> int:
        """Padded block-table width for a widest table of n blocks."""
        return next_bucket(n, self.min_blocks)


def next_bucket(n: int, minimum: int) -> int:
    """`minimum` when n <= minimum, else the smallest power of two >= n."""
    if n <= minimum:
        return minimum
    return 1 << (n - 1).bit_length()


class StepGraph:
    """A recorded sequence of device work replayed on the tensors it was captured on.

    `capture(pool)` is a context manager recording the work queued inside it (not running it);
    `pool()` is the memory pool the capture allocated from, which later captures may share;
    `replay()` queues the recorded work again. The cuda adapter wraps torch.cuda.CUDAGraph.
    """

    def capture(self, pool: Any = None) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def pool(self) -> Any:
        raise NotImplementedError

    def replay(self) -> None:
        raise NotImplementedError


class DeviceAdapter:
    """The few device services the engine needs, implemented per device type.

    The defaults go through `torch.get_device_module(device_type)`, which covers devices that
    follow torch's accelerator conventions (cuda, xpu, npu with torch_npu, ...).
    `shape_buckets` is None for devices that run any shape as is; a static-shape device sets it
    to have the model runner pad every batch (see ShapeBuckets).
    """

    dist_backend: str = "gloo"
    # the Ray resource one tensor-parallel rank on this device reserves ("GPU": Ray's num_gpus;
    # another name: a custom resource the cluster declares); None reserves a CPU only
    cluster_resource: str | None = None
    shape_buckets: ShapeBuckets | None = None

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def _module(self) -> Any:
        return torch.get_device_module(self.device_type)

    def set_device(self, device: torch.device) -> None:
        """Make `device` the current device of its type (no-op where there is no such notion)."""
        if device.index is not None:
            self._module().set_device(device.index)

    def synchronize(self, device: torch.device) -> None:
        """Wait for all queued work on `device`."""
        self._module().synchronize(device)

    def record_event(self, device: torch.device) -> Any:
        """An event recorded now on `device`'s current stream; its synchronize() waits for the work before it."""
        event = self._module().Event()
        event.record()
        return event

    def empty_cache(self, device: torch.device) -> None:
        """Hand memory the framework caches but no tensor holds back to the device (no-op where there is none)."""
        release = getattr(self._module(), "empty_cache", None)
        if release is not None:
            release()

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free_bytes, total_bytes) of device memory."""
        return self._module().mem_get_info(device)

    def new_graph(self, device: torch.device) -> StepGraph | None:
        """An empty replayable graph for `device` (see StepGraph), or None when the device has none.

        The model runner captures decode steps into such graphs (flashllm/core/step_graphs.py)
        unless --enforce-eager; devices with graphs of their own implement StepGraph on them.
        """
        return None

    def inference_mode(self) -> AbstractContextManager[Any]:
        """The grad mode the model runner's forward pass runs in: torch.inference_mode() by default.

        Devices whose tensors cannot be inference tensors (torch_xla: its functionalization sets
        version counters) return torch.no_grad() instead.
        """
        return torch.inference_mode()

    def end_step(self, device: torch.device) -> None:
        """Called by the model runner after each forward pass, before sampling (a no-op by default).

        Lazy-tensor devices (XLA) cut and run the traced graph here, so the KV cache updates of
        one step do not pile up into the next step's graph.
        """
        return None


Availability = tuple[bool, str]
"""(available, reason): the reason says why not, or what was found when available."""


@dataclass
class Backend:
    """A device backend: a name, a torch device type, a priority and a table of kernels.

    Subclass it (or pass callables) to describe the device: `is_available()` must explain itself
    when it returns False, `device_profile()` says which precisions the device at hand can run,
    `known_profiles()` lists the device generations rendered in the capability matrix.
    `proof` is one of PROOF_LEVELS: how the claims of this backend are proven.
    `model_runner` names the backend's own model runner class, if it has one (its fast paths).
    """

    name: str
    device_type: str
    priority: int
    description: str = ""
    install_hint: str = ""
    kernels: dict[str, list[Kernel]] = field(default_factory=dict, repr=False)
    proof: str = DEFAULT_PROOF
    # "package.module:Class", a subclass of flashllm.core.model_runner.ModelRunner that runs this
    # backend's steps (imported when an engine starts on it); None: the generic runner
    model_runner: str | None = None

    def __post_init__(self) -> None:
        if self.proof not in PROOF_LEVELS:
            raise ValueError(
                f"backend {self.name!r} declares proof level {self.proof!r}; expected one of "
                f"{', '.join(PROOF_LEVELS)} (omit it to default to {DEFAULT_PROOF!r})"
            )

    def kernel(self, op: str, caps: Caps) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering `fn` as this backend's kernel for `op` with `caps`.

        The function's signature must match the op spec exactly (names, order, kinds, defaults);
        a mismatch raises KernelSignatureError at registration, not at the first call.
        """

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            spec = _spec(op)
            check_signature(fn, spec)
            self.kernels.setdefault(op, []).append(Kernel(op, fn, caps, self.name))
            return fn

        return register

    # -- device facts: override in subclasses -------------------------------------------------
    def is_available(self) -> Availability:
        """Whether this backend can run here, and why (not)."""
        return True, "always available"

    def device_count(self) -> int:
        """How many devices of this backend's type are visible."""
        return 1

    def device_profile(self, device: torch.device) -> DeviceProfile:
        """The precisions the given device can run (called only when available)."""
        raise NotImplementedError(f"backend {self.name!r} does not describe its devices")

    def known_profiles(self) -> list[DeviceProfile]:
        """Device generations this backend documents, for the capability matrix."""
        return []

    def adapter(self) -> DeviceAdapter:
        """The DeviceAdapter for this backend's devices."""
        return DeviceAdapter(self.device_type)


def check_signature(fn: Callable[..., Any], spec: OpSpec) -> None:
    """Raise KernelSignatureError unless `fn` has exactly the parameters of `spec`."""
    want = _param_shape(spec.signature)
    got = _param_shape(inspect.signature(fn))
    if want != got:
        raise KernelSignatureError(
            f"kernel {getattr(fn, '__qualname__', fn)!r} for op {spec.name!r} has parameters "
            f"{_fmt(got)}; the op spec requires {_fmt(want)} (names, order, kinds and defaults)"
        )


def _param_shape(sig: inspect.Signature) -> list[tuple[str, str, Any]]:
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]


def _fmt(shape: list[tuple[str, str, Any]]) -> str:
    parts = [n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, _, d in shape]
    return "(" + ", ".join(parts) + ")"


_SPECS: dict[str, OpSpec] | None = None


def _spec(op: str) -> OpSpec:
    global _SPECS  # a cache of immutable data: op files are imported once per process
    if _SPECS is None:
        _SPECS = op_specs()
    if op not in _SPECS:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(_SPECS)}")
    return _SPECS[op]


def _allowed(value: int | None, allowed: frozenset[int] | None) -> bool:
    return allowed is None or value is None or value in allowed


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: frozenset[torch.dtype]) -> str:
    return "{" + ", ".join(sorted(_dtype_name(d) for d in dtypes)) + "}"
