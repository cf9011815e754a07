"""The refit group moves named tensors of any dtype and shape from rank 0 to every receiver exactly."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from grpo_app.refit import RefitGroup, tcp_store
from rl_core.testing.distributed import run_distributed


def tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 7, generator=gen)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(3, 2, 2, generator=gen, dtype=torch.float64)),
        ("scalar", torch.tensor(4, dtype=torch.int64)),
    ]


def _refit_group(rank: int, world_size: int, **kwargs) -> RefitGroup:
    """The refit group as the trainer forms it: rank 0 opens the store on a port its OS picks, the others are told it."""
    store = tcp_store("127.0.0.1", 0, world_size, True) if rank == 0 else None
    port = [store.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    store = store or tcp_store("127.0.0.1", port[0], world_size, False)
    return RefitGroup(store, rank, world_size, **kwargs)


def tensors_of_every_kind() -> list[tuple[str, torch.Tensor]]:
    """Odd byte counts (so alignment matters), every dtype refit sends, an empty and a non-contiguous tensor."""
    gen = torch.Generator().manual_seed(1)
    return [*tensors(), ("bool", torch.tensor([True, False, True])), ("int8", torch.tensor([-3, 7], dtype=torch.int8)),
            ("uint8", torch.arange(5, dtype=torch.uint8)), ("half", torch.randn(3, generator=gen).half()),
            ("int32", torch.arange(3, dtype=torch.int32)), ("empty", torch.zeros(0, 4)),
            ("transposed", torch.randn(3, 5, generator=gen).t())]


def _refit(rank: int, world_size: int, bucket_bytes: int):
    group = _refit_group(rank, world_size)
    if rank == 0:
        return group.send(tensors_of_every_kind(), bucket_bytes=bucket_bytes)
    return [(name, tensor.clone()) for name, tensor in group.receive()]


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_bytes", [1, 64, 2**20], ids=["one_tensor_a_bucket", "a_few_a_bucket", "one_bucket"])
def test_refit_broadcasts_every_tensor_bit_exactly(bucket_bytes: int):
    results = run_distributed(_refit, world_size=3, args=(bucket_bytes,))
    sent = tensors_of_every_kind()
    assert results[0] == sum(t.numel() * t.element_size() for _, t in sent)
    for received in results[1:]:
        assert [n for n, _ in received] == [n for n, _ in sent]
        for (_, a), (_, b) in zip(received, sent):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _sender_holding(rank: int, world_size: int, bucket_bytes: int):
    """Rank 0 sends small tensors and one larger than a bucket, made one at a time, and records how many earlier
    tensors' storages are still alive as each next tensor is made (storage weak references: a detached view keeps
    its storage) and the largest tensor it allocates (a dispatch mode over `send`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    group = _refit_group(rank, world_size)
    sizes = [40, 24, 24, 3 * bucket_bytes, 8, 16]  # bytes (float32)
    if rank != 0:
        return [(name, tensor.clone()) for name, tensor in group.receive()]

    class LargestAllocation(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default):
                LargestAllocation.largest = max(LargestAllocation.largest, out.numel() * out.element_size())
            return out

    made, held = [], []  # the storages of the tensors copied into buckets (the large one is broadcast as it is,
    # and gloo's worker thread may still hold a collective's tensor for a moment after wait() returned)

    def export():
        for i, nbytes in enumerate(sizes):
            held.append(sum(not torch.UntypedStorage._expired(ref) for ref in made))  # what the sender still holds
            tensor = torch.full((nbytes // 4,), float(i))
            if nbytes < bucket_bytes:
                made.append(tensor.untyped_storage()._weak_ref())
            yield f"t{i}", tensor
            del tensor

    with LargestAllocation():
        group.send(export(), bucket_bytes=bucket_bytes)
    for ref in made:
        torch.UntypedStorage._free_weak_ref(ref)
    return held, LargestAllocation.largest


@pytest.mark.distributed
def test_refit_sender_holds_one_bucket_buffer_and_no_tensor_it_has_copied():
    """Each tensor is copied into the bucket as it arrives and let go (the sender kept a bucket's tensors until
    it was sent, beside their copy: twice a bucket on a GPU), and a tensor larger than a bucket goes as it is,
    with no copy (a bucket could reach 256 MiB + the largest tensor)."""
    bucket_bytes = 64
    (held, largest), received = run_distributed(_sender_holding, world_size=2, args=(bucket_bytes,))
    assert held == [0] * 6
    assert largest <= bucket_bytes  # the one buffer; the 192-byte tensor was not copied
    assert [name for name, _ in received] == [f"t{i}" for i in range(6)]
    assert all(torch.equal(t, torch.full_like(t, float(i))) for i, (_, t) in enumerate(received))
    assert [t.numel() * 4 for _, t in received] == [40, 24, 24, 3 * bucket_bytes, 8, 16]


def _refused_refit(rank: int, world_size: int):
    """Rank 0 sends a tensor of the wrong shape, then a good refit; rank 1's loader refuses the bad one."""
    group = _refit_group(rank, world_size, timeout_s=20.0)  # old code: blocked until here
    good = tensors()
    bad = [(name, torch.zeros(2, 2) if i == 1 else t) for i, (name, t) in enumerate(good)]
    bad.insert(2, ("model.norm.weight", torch.zeros(2**22)))  # 16 MB: more than socket buffers hold
    start = time.monotonic()
    if rank == 0:
        group.send(bad)
        elapsed = time.monotonic() - start
        group.send(good)
        return elapsed

    def strict_load(stream):  # what a backend's update_weights does with a shape it does not expect
        shapes = {name: t.shape for name, t in good} | {"model.norm.weight": torch.Size([2**22])}
        for name, tensor in stream:
            if tensor.shape != shapes[name]:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}")

    try:
        group.receive_into(strict_load)
        error = None
    except ValueError as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    return error, elapsed, [(name, t) for name, t in group.receive()]


@pytest.mark.distributed
def test_refused_tensor_raises_on_the_receiver_and_releases_the_sender():
    """A receiver that refuses a tensor still reads the stream to its end: it raises its error at once,
    the sender returns (not after the group timeout), and the next refit arrives whole."""
    sent_s, (error, received_s, next_refit) = run_distributed(_refused_refit, world_size=2, timeout=60)
    assert error == "update_weights: 'model.layers.0.self_attn.q_proj.bias' has shape (2, 2)"
    assert sent_s < 10 and received_s < 10, (sent_s, received_s)
    assert [n for n, _ in next_refit] == [n for n, _ in tensors()]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(next_refit, tensors()))


def test_in_process_refit_streams_one_tensor_at_a_time(tmp_path):
    """The generator loads each tensor before the next one is produced (no full state-dict copy in
    between), and ends with exactly the exported weights."""
    from grpo_app.refit import refit_in_process
    from rl_core.testing.tiny_models import save_tiny_checkpoint
    from rollout.torch_backend import TorchGenerationBackend

    backend = TorchGenerationBackend(str(save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=0)))
    params = dict(backend.model.named_parameters())
    new = {name: torch.randn_like(p) for name, p in params.items()}
    loaded_before_next = []

    def export():
        previous = None
        for name, tensor in new.items():
            if previous is not None:  # the consumer has copied the previous tensor before asking for this one
                loaded_before_next.append(torch.equal(params[previous], new[previous]))
            previous = name
            yield name, tensor

    sent = refit_in_process(export(), backend)
    assert loaded_before_next and all(loaded_before_next)
    assert all(torch.equal(params[name], tensor) for name, tensor in new.items())
    assert sent == sum(t.numel() * t.element_size() for t in new.values())
