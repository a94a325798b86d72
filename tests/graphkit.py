"""What a CUDA graph's replay would get wrong, checked on any device: forwards run under a dispatch
mode that records host syncs and reads of tensors a replay would hold stale."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from goodspeed.drafter.runner import DraftRunner, SlotDraftKV
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.runtime.graphs import StepGraphs, cpp_compiler_missing


class ReadsOnly(TorchDispatchMode):
    """Records what would break a CUDA graph's replays: a sync with the host (``item``, a tensor
    made from host data, an op whose output size depends on values), or a read of a tensor that is
    neither one of ``allowed`` (weights, KV pool, static inputs) nor made by the forward itself,
    which a replay would read as it was at capture. (A ``.tolist()`` or ``.cpu()`` of a CPU tensor
    dispatches nothing, so those are left to the CUDA test, where a capture refuses them.)"""

    SYNCS = {"aten._local_scalar_dense.default", "aten.lift_fresh.default", "aten.nonzero.default",
             "aten.masked_select.default", "aten.unique.default"}

    def __init__(self, allowed):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in allowed}
        self.problems = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) in self.SYNCS:
            self.problems.append(f"{func}: a host sync")
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in self.known:
                self.problems.append(f"{func} reads a {tuple(t.shape)} tensor made before the forward")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.known.add(t.untyped_storage().data_ptr())
        return out


def static_inputs(owner, shape):
    """What a replay of ``shape`` may read: the weights, the KV pool, the shape's static inputs
    (``owner``: an engine or a batch draft model)."""
    model, cache = owner.model, owner.cache
    return [*model.parameters(), *model.buffers(), *(b for b in (*cache.keys, *cache.values) if b is not None),
            shape.input_ids, shape.position_ids, shape.mask, shape.write_rows, shape.write_pos]


def checking(owner, seen):
    """Run ``owner``'s graph forwards under :class:`ReadsOnly`, each one's findings into ``seen``."""
    forward = owner.graphs._forward

    def checked(shape):
        with ReadsOnly(static_inputs(owner, shape)) as mode:
            out = forward(shape)
        seen.append(mode.problems)
        return out
    owner.graphs._forward = checked


def static_drafter(runner: DraftRunner) -> BatchDraftModel:
    """Give ``runner`` a slot of a batch draft model whose forwards go through StepGraphs without
    capturing (what ``cuda_graphs`` runs, the capture apart); returns that draft model."""
    drafter = BatchDraftModel(runner.model)
    drafter.graphs = StepGraphs(drafter.model, drafter.cache, capture=False)
    runner.kv = SlotDraftKV(drafter)
    return drafter


def static_runner(model) -> DraftRunner:
    """A runner drafting through :func:`static_drafter`'s fixed-shape forwards."""
    runner = DraftRunner(model)
    static_drafter(runner)
    return runner


# torch.compile on a CPU: inductor builds C++ (a machine without a compiler refuses the setting)
needs_cpp = pytest.mark.skipif(cpp_compiler_missing() is not None,
                               reason="torch.compile on a CPU needs a C++ compiler (apt-get install g++)")


@pytest.fixture
def fresh_dynamo():
    """Dynamo with no compiled graph and no size seen: every Llama decoder shares its cache and its
    automatic-dynamic state (one code object), so a test that counts graphs must not meet another
    test's."""
    import torch._dynamo

    torch._dynamo.reset()
