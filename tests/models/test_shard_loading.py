"""A tensor-parallel rank reads only its shard of each checkpoint tensor, and holds exactly that shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import flashllm.models.loader as loader
from flashllm.models.checkpoint_tensor import CheckpointTensor
from flashllm.models.loader import load_model
from flashllm.testing.tiny_models import build_tiny_model

# per tensor of the tiny llama (hidden 64, 4 query heads and 2 kv heads of 16, intermediate 128,
# vocab 256): the dimension split over two ranks, None where every rank holds the whole tensor
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
             "embed_tokens": 0, "lm_head": 0, "input_layernorm": None, "post_attention_layernorm": None,
             "norm": None}


class RecordingFile:
    """safe_open's handle, noting every element range a caller reads (get_tensor reads everything)."""

    def __init__(self, handle, reads: list[tuple[str, tuple[int, ...], int]]) -> None:
        self._handle, self._reads = handle, reads

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, name: str):
        tensor = self._handle.get_tensor(name)
        self._reads.append((name, tuple(tensor.shape), tensor.numel()))
        return tensor

    def get_slice(self, name: str):
        return RecordingSlice(name, self._handle.get_slice(name), self._reads)


class RecordingSlice:
    def __init__(self, name: str, source, reads: list) -> None:
        self._name, self._source, self._reads = name, source, reads

    def get_shape(self):
        return self._source.get_shape()

    def get_dtype(self):
        return self._source.get_dtype()

    def __getitem__(self, index):
        tensor = self._source[index]
        self._reads.append((self._name, tuple(self._source.get_shape()), tensor.numel()))
        return tensor


@pytest.fixture
def recorded_reads(monkeypatch) -> list[tuple[str, tuple[int, ...], int]]:
    """(tensor name, its whole shape, elements read) for every read the loader makes from the files."""
    reads: list[tuple[str, tuple[int, ...], int]] = []

    class RecordingOpen:
        def __init__(self, *args, **kwargs) -> None:
            self._ctx = safe_open(*args, **kwargs)

        def __enter__(self):
            return RecordingFile(self._ctx.__enter__(), reads)

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

    monkeypatch.setattr(loader, "safe_open", RecordingOpen)
    return reads


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=5, tokenizer=False)


def _module_of(name: str) -> str:
    return name.removesuffix(".weight").rsplit(".", 1)[-1]


def _read_elements(reads) -> dict[str, int]:
    totals: dict[str, int] = {}
    for name, _, count in reads:
        totals[name] = totals.get(name, 0) + count
    return totals


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_half_of_each_sharded_tensor_and_all_of_each_replicated_one(
    llama_dir, ops, model_registry, recorded_reads, rank
):
    load_model(llama_dir, ops, torch.float32, "cpu", model_registry, progress=False, tp_rank=rank, tp_size=2)
    shapes = {name: shape for name, shape, _ in recorded_reads}
    assert {_module_of(name) for name in shapes} == set(SPLIT_DIM)  # every tensor of the checkpoint was seen
    for name, count in _read_elements(recorded_reads).items():
        whole = torch.Size(shapes[name]).numel()
        expected = whole if SPLIT_DIM[_module_of(name)] is None else whole // 2
        assert count == expected, f"{name}: rank {rank} read {count} of {whole} elements, expected {expected}"


def test_one_rank_reads_everything_once(llama_dir, ops, model_registry, recorded_reads):
    load_model(llama_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    shapes = {name: shape for name, shape, _ in recorded_reads}
    assert _read_elements(recorded_reads) == {name: torch.Size(shape).numel() for name, shape in shapes.items()}


def _rank_slice(whole: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """What rank `rank` of two must hold of the single-rank parameter `name`, by the layout of each layer."""
    if ".qkv_proj." in name:  # [q 64 | k 32 | v 32] rows -> each rank [q 32 | k 16 | v 16]
        q, k, v = whole.split([64, 32, 32])
        return torch.cat([q[32 * rank:32 * (rank + 1)], k[16 * rank:16 * (rank + 1)], v[16 * rank:16 * (rank + 1)]])
    if ".gate_up_proj." in name:  # [gate 128 | up 128] -> each rank [gate 64 | up 64]
        gate, up = whole.split([128, 128])
        return torch.cat([gate[64 * rank:64 * (rank + 1)], up[64 * rank:64 * (rank + 1)]])
    if ".o_proj." in name or ".down_proj." in name:  # input features split
        half = whole.shape[1] // 2
        return whole[:, half * rank:half * (rank + 1)]
    if "embed_tokens" in name or "lm_head" in name:  # vocabulary split
        return whole[128 * rank:128 * (rank + 1)]
    return whole


@pytest.mark.parametrize("preset", ["llama", "qwen2"])
def test_each_rank_holds_its_slice_of_the_single_rank_parameters(tmp_path, ops, model_registry, preset):
    model_dir = build_tiny_model(tmp_path, preset, seed=2, tokenizer=False)
    whole = dict(load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)[0].named_parameters())
    for rank in range(2):
        model = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False, tp_rank=rank, tp_size=2)[0]
        params = dict(model.named_parameters())
        assert params.keys() == whole.keys()
        for name, param in params.items():
            if name.endswith(".bias"):  # qwen2's q/k/v biases (the only ones) follow the weight rows
                assert ".qkv_proj." in name
                expected = _rank_slice(whole[name][:, None], name, rank)[:, 0]
            else:
                expected = _rank_slice(whole[name], name, rank)
            assert torch.equal(param, expected), f"rank {rank}: {name}"


def test_a_too_small_checkpoint_tensor_is_refused_by_name_on_a_rank(tmp_path, ops, model_registry):
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path, "llama", seed=2, tokenizer=False)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :96].contiguous()  # 96 input features instead of 128
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(loader.ModelLoadError, match=r"down_proj\.weight.*\(64, 96\).*\(64, 128\)"):
        load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False, tp_rank=1, tp_size=2)


# ---------------------------------------------------------------- CheckpointTensor


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_narrowing_reads_exactly_the_narrowed_elements(tmp_path_factory, shape, data):
    path = tmp_path_factory.mktemp("ct") / "t.safetensors"
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    save_file({"t": whole}, path)
    reads: list = []
    with safe_open(path, framework="pt") as f:
        lazy = CheckpointTensor.open("t", RecordingSlice("t", f.get_slice("t"), reads))
        reads.clear()  # the dtype probe reads no element; count only what follows
        expected = whole
        for _ in range(data.draw(st.integers(1, 3))):
            dim = data.draw(st.integers(0, len(shape) - 1))
            start = data.draw(st.integers(0, expected.shape[dim]))
            length = data.draw(st.integers(0, expected.shape[dim] - start))
            lazy, expected = lazy.narrow(dim, start, length), expected.narrow(dim, start, length)
        assert tuple(lazy.shape) == tuple(expected.shape) and lazy.dtype == torch.float32
        assert not reads
        assert torch.equal(lazy.materialize(), expected)
        assert sum(count for _, _, count in reads) == expected.numel()


def test_a_checkpoint_tensor_works_where_a_tensor_is_expected(tmp_path):
    path = tmp_path / "t.safetensors"
    whole = torch.randn(4, 6)
    save_file({"t": whole, "s": torch.tensor(2.5)}, path)
    with safe_open(path, framework="pt") as f:
        lazy = CheckpointTensor.open("t", f.get_slice("t"))
        scalar = CheckpointTensor.open("s", f.get_slice("s"))
        target = torch.zeros(2, 6)
        target.copy_(lazy[2:4])  # a torch function reads its argument
        assert torch.equal(target, whole[2:])
        assert torch.equal(torch.cat([lazy, lazy[:1]]), torch.cat([whole, whole[:1]]))
        assert torch.equal(lazy.to(torch.float64), whole.double())  # any other Tensor attribute
        assert torch.equal(lazy[:, None][1], whole[1][None])  # an index it cannot keep lazy
        assert scalar.dim() == 0 and float(scalar.materialize()) == 2.5
        with pytest.raises(ValueError, match=r"needs \[3, 7\)"):
            lazy.narrow(0, 3, 4)
