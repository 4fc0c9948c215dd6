"""Tensor-parallel ranks: the process group, this rank's place in it, and the step channel.

Every rank holds a shard of the model and of the KV cache and runs every forward pass; the
layers' all-reduce / all-gather (flashllm/models/layers) cross the ranks. Rank 0, the driver,
schedules and samples; before each forward pass it sends the step's flat inputs to the other
ranks over the step channel, as plain int64 tensors (never pickled objects). With multi-LoRA the
step also carries each token's adapter slot and the driver's adapter slot loads since the last
step (JSON: slot, id, name, directory), which the other ranks repeat from the same directories.
While the engine idles the driver pings the ranks over the same channel (the executor's heartbeat),
so a rank that hangs is noticed without a step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flashllm.core.model_runner import ModelInput
from flashllm.core.runner_select import EngineConfigError
from flashllm.ops.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# How long a collective may wait for a rank before the engine fails (a rank that hangs); a rank
# that dies fails its peers' collectives at once.
DIST_TIMEOUT_ENV = "FLASHLLM_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 60.0
# A rank still starting (importing torch, loading its shard) is slow, not hung: the driver waits for every rank's
# announcement at least this long, whatever the collectives' timeout (a rank that exits is reported at once).
MIN_START_TIMEOUT_S = 60.0
# How long an idle engine goes without a word with its ranks before the driver pings them (0: never);
# a rank that hangs is then noticed within this plus the timeout, without waiting for a request.
HEARTBEAT_ENV = "FLASHLLM_DIST_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 5.0
# How long a rank other than the driver waits for the driver's next message: as long as the engine
# idles (a year stands for ever). A driver that dies closes its sockets, which ends the wait at once.
IDLE_WAIT = timedelta(days=365)

# command, tokens, sequences, block-table width, logits rows, num_logits + 1, max q, max k, LoRA slot rows
# (0 or tokens), bytes of LoRA slot loads, prompt-length rows (0 or sequences: AttentionMetadata.prompt_lens),
# prompt-logprob LM-head blocks (ModelInput.prompt_logit_blocks: two ids each)
_HEADER = 13
MAX_LOAD_BYTES = 1 << 20  # a step's slot loads: at most 256 adapters' names and paths
_STEP, _STOP, _PING = 1, 0, 2


class DistributedError(RuntimeError):
    """A tensor-parallel rank died, hung or could not start; the message names it and what to do."""


def dist_timeout() -> timedelta:
    """The collectives' timeout: FLASHLLM_DIST_TIMEOUT_S seconds (default 60); EngineConfigError if malformed."""
    return timedelta(seconds=_seconds(DIST_TIMEOUT_ENV, DEFAULT_DIST_TIMEOUT_S, "a positive number of seconds"))


def heartbeat_interval() -> float:
    """FLASHLLM_DIST_HEARTBEAT_S: seconds an idle engine waits before pinging its ranks (default 5; 0: off);
    EngineConfigError if malformed."""
    return _seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S, "0 (off) or a positive number of seconds", zero=True)


def _seconds(name: str, default: float, need: str, zero: bool = False) -> float:
    """The environment's `name` as seconds: `need` says what it must be (a configuration error, in one line)."""
    raw = os.environ.get(name, str(default))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf or (zero and seconds == 0)):
        raise EngineConfigError(f"{name}={raw!r} must be {need}; fix or unset it")
    return seconds


@dataclass(frozen=True)
class RankContext:
    """This process's rank among `world_size` tensor-parallel ranks (one rank: no process group).

    local_rank picks the device index on machines with several accelerators.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def select(self, selection: Any) -> Any:
        """The device selection for this rank: device index local_rank on indexable accelerators."""
        if self.world_size == 1 or selection.device.type == "cpu" or selection.device.index is not None:
            return selection
        device = torch.device(selection.device.type, self.local_rank)
        return type(selection)(device, selection.backend, selection.profile, selection.adapter)

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (each rank's KV cache must hold the same blocks)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
        return int(t.item())


_CONTROL: Any = None


def rendezvous(address: str, rank: RankContext) -> Any:
    """The ranks' key-value store at `address` ("host:port"): rank 0 serves it, the others connect
    and announce themselves, so the driver can tell a rank that never started from a slow one."""
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), rank.world_size, is_master=rank.rank == 0, timeout=dist_timeout(),
                          wait_for_workers=False)
    if rank.rank != 0:
        store.set(f"flashllm/ready/{rank.rank}", "1")
    return store


def wait_for_ranks(store: Any, world_size: int, failed: Callable[[], str | None]) -> None:
    """Driver: wait until every other rank announced itself, raising DistributedError at once when
    `failed()` reports one that exited, or after the collectives' timeout (at least MIN_START_TIMEOUT_S)."""
    limit = max(dist_timeout().total_seconds(), MIN_START_TIMEOUT_S)
    deadline = time.monotonic() + limit
    keys = [f"flashllm/ready/{r}" for r in range(1, world_size)]
    while not store.check(keys):
        reason = failed()
        if reason is not None:
            raise DistributedError(f"{reason} while starting; see its log above")
        if time.monotonic() > deadline:
            raise DistributedError(f"tensor-parallel ranks did not start within {limit:g} s (the larger of "
                                   f"{DIST_TIMEOUT_ENV} and {MIN_START_TIMEOUT_S:g} s)")
        time.sleep(0.05)


def init_process_group(rank: RankContext, backend: str, *, store: Any = None, init_method: str | None = None) -> None:
    """Join the ranks' process group (`backend`: the device's, e.g. nccl or gloo) through `store` (or
    `init_method`, e.g. torchrun's env://) and make the gloo group the step channel uses (the
    default group itself where that is gloo already)."""
    global _CONTROL  # one process group per process, as torch.distributed has
    if dist.is_initialized():
        raise DistributedError("this process already joined a process group; one engine per process with "
                               "tensor parallelism")
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank.rank,
                            world_size=rank.world_size, timeout=dist_timeout())
    _CONTROL = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=dist_timeout())


def control_group() -> Any:
    return _CONTROL if _CONTROL is not None else dist.group.WORLD


def destroy_process_group() -> None:
    global _CONTROL
    _CONTROL = None
    if dist.is_initialized():
        dist.destroy_process_group()


class StepChannel:
    """Rank 0 sends each step's ModelInput to the other ranks; they receive it and run the same step.

    lora: this rank's multi-LoRA manager (flashllm/lora/manager.py), or None. The driver's (driver
    True) then keeps its slot loads for send() to carry; the other ranks' receive() repeats them and
    sets each step's per-token slots in their manager's context before returning the inputs.
    """

    def __init__(self, device: torch.device, lora: Any = None, driver: bool = False) -> None:
        self.device = device
        self.lora = lora
        if lora is not None and driver:
            lora.slot_loads = []

    def send(self, inputs: ModelInput) -> None:
        """Driver: broadcast one step's inputs (call before running the step itself)."""
        md = inputs.attn_metadata
        tables = md.block_tables
        lora_slots = None if self.lora is None else self.lora.context.indices
        loads = b""
        if self.lora is not None and self.lora.slot_loads:
            loads = json.dumps([[slot, r.lora_int_id, r.lora_name, r.lora_path]
                                for slot, r in self.lora.slot_loads]).encode()
            self.lora.slot_loads.clear()
        if len(loads) > MAX_LOAD_BYTES:
            raise ValueError(f"a step's LoRA slot loads take {len(loads)} bytes, more than the step channel's "
                             f"{MAX_LOAD_BYTES}; use shorter adapter names or paths")
        extra = () if lora_slots is None else (lora_slots,)
        prompt_lens = () if md.prompt_lens is None else (md.prompt_lens,)
        state_slots = () if md.state_slots is None else (md.state_slots,)
        blocks = torch.tensor(inputs.prompt_logit_blocks or [], dtype=torch.int64).reshape(-1)
        header = torch.tensor([_STEP, inputs.input_ids.numel(), md.seq_lens.numel(), tables.shape[1],
                               inputs.logits_indices.numel(), -1 if inputs.num_logits is None else inputs.num_logits,
                               md.max_seqlen_q, md.max_seqlen_k, 0 if lora_slots is None else lora_slots.numel(),
                               len(loads), 0 if md.prompt_lens is None else md.prompt_lens.numel(),
                               blocks.numel() // 2, 0 if md.state_slots is None else md.state_slots.numel()],
                              dtype=torch.int64)
        payload = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in (
            inputs.input_ids, inputs.positions, md.slot_mapping, md.cu_seqlens_q, md.seq_lens, tables,
            inputs.logits_indices, *extra, *prompt_lens, blocks, *state_slots)])
        group = control_group()
        dist.broadcast(header, src=0, group=group)
        dist.broadcast(payload, src=0, group=group)
        if loads:
            dist.broadcast(torch.frombuffer(bytearray(loads), dtype=torch.uint8), src=0, group=group)

    def ping(self) -> None:
        """Driver: a liveness round that every rank answers (a barrier); RuntimeError after
        FLASHLLM_DIST_TIMEOUT_S if a rank hangs, at once if one died."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _PING
        dist.broadcast(header, src=0, group=control_group())
        # the broadcast alone can return before a stopped rank reads it (the bytes wait in its socket)
        dist.barrier(group=control_group())

    def send_stop(self) -> None:
        """Driver: tell the other ranks to leave their loops."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _STOP
        dist.broadcast(header, src=0, group=control_group())
        # every rank has read the stop before any tears its group down: a rank that closed its sockets
        # while another was still reading would fail that one's last collective
        dist.barrier(group=control_group())

    def _repeat_loads(self, data: bytes) -> None:
        """Other ranks: the driver's slot loads, in its order, into this rank's tables."""
        from flashllm.lora.manager import LoRARequest

        if self.lora is None:
            raise DistributedError("the driver sent LoRA slot loads to a rank without multi-LoRA tables")
        for slot, lora_id, name, path in json.loads(data):
            self.lora.load_into(int(slot), LoRARequest(str(name), int(lora_id), str(path)))

    def receive(self) -> ModelInput | None:
        """Other ranks: the next step's inputs, or None when the driver stops; waits as long as the
        driver idles, answering its pings."""
        group = control_group()
        while int((header := _next_header(group))[0]) == _PING:
            dist.barrier(group=group)  # the driver's ping waits here too
        (command, tokens, seqs, width, rows, num_logits, max_q, max_k, lora_rows, load_bytes, prompt_rows,
         num_blocks, state_rows) = header.tolist()
        if command == _STOP:
            dist.barrier(group=group)  # the driver's send_stop waits here too
            return None
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, rows, lora_rows, prompt_rows, 2 * num_blocks,
                 state_rows]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        dist.broadcast(payload, src=0, group=group)
        (ids, positions, slots, cu, seq_lens, tables, logits_rows, lora_slots, prompt_lens, blocks,
         state_slots) = payload.split(sizes)
        if load_bytes:
            loads = torch.empty(load_bytes, dtype=torch.uint8)
            dist.broadcast(loads, src=0, group=group)
            self._repeat_loads(bytes(loads.numpy()))
        if self.lora is not None:
            self.lora.context.indices = lora_slots.to(self.device) if lora_rows else None
        elif lora_rows:
            raise DistributedError("the driver sent LoRA slots to a rank without multi-LoRA tables")

        def on_device(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(self.device, dtype)

        metadata = AttentionMetadata(
            slot_mapping=on_device(slots, torch.int64), cu_seqlens_q=on_device(cu, torch.int32),
            seq_lens=on_device(seq_lens, torch.int32), block_tables=on_device(tables.view(seqs, width), torch.int32),
            max_seqlen_q=max_q, max_seqlen_k=max_k,
            prompt_lens=on_device(prompt_lens, torch.int32) if prompt_rows else None,
            state_slots=on_device(state_slots, torch.int64) if state_rows else None)
        return ModelInput(input_ids=on_device(ids, torch.int64), positions=on_device(positions, torch.int64),
                          attn_metadata=metadata, logits_indices=on_device(logits_rows, torch.int64),
                          num_logits=None if num_logits < 0 else num_logits,
                          prompt_logit_blocks=[tuple(b) for b in blocks.view(-1, 2).tolist()] or None)


def _next_header(group: Any) -> torch.Tensor:
    """Other ranks: the driver's next header, however long the engine idles in between. The group's
    timeout bounds a collective under way, not the gap between two (dist.broadcast would fail an idle
    rank after FLASHLLM_DIST_TIMEOUT_S)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor, options.timeout = 0, 0, IDLE_WAIT  # the control group spans every rank
    group.broadcast([header], options).wait()
    return header
