"""Each model keeps its own context-parallel handle (no process-wide state): `bind` gives a model
its handle, its forward makes it the current one and restores the one before, so two models with
different cp settings in one process, one inside the other's forward or in two threads at once,
each see their own; outside any forward there is none."""

from __future__ import annotations

import threading

import torch
from torch import nn

from trident.context_parallel import ContextParallel, bind, current, using


def handle(method: str) -> ContextParallel:
    return ContextParallel(group=None, size=1, rank=0, method=method)


class Recorder(nn.Module):
    """Records the handle `current()` gives inside its forward (before and after an inner model)."""

    def __init__(self, inner: nn.Module | None = None, wait: threading.Barrier | None = None) -> None:
        super().__init__()
        self.inner, self.wait, self.seen = inner, wait, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(current())
        if self.wait is not None:
            self.wait.wait(timeout=10)  # both threads are inside their model's forward now
        if self.inner is not None:
            x = self.inner(x)
            self.seen.append(current())
        return x


def test_a_model_inside_another_sees_its_own_handle():
    ring, ulysses = handle("ring"), handle("ulysses")
    inner = Recorder()
    outer = Recorder(inner)
    bind(outer, ring)
    bind(inner, ulysses)
    outer(torch.zeros(1))
    assert outer.seen == [ring, ring] and inner.seen == [ulysses]
    assert outer.context_parallel is ring and inner.context_parallel is ulysses
    assert current() is None


def test_two_models_in_two_threads_at_once_see_their_own_handles():
    barrier = threading.Barrier(2)
    models = [Recorder(wait=barrier), Recorder(wait=barrier)]
    handles = [handle("ring"), handle("hybrid")]
    for model, cp in zip(models, handles):
        bind(model, cp)
    threads = [threading.Thread(target=model, args=(torch.zeros(1),)) for model in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert [m.seen for m in models] == [[handles[0]], [handles[1]]]


def test_an_unbound_model_sees_none_and_rebinding_takes_effect():
    bound, plain = Recorder(), Recorder()
    bind(bound, handle("ring"))
    plain(torch.zeros(1))
    new = handle("ulysses")
    bind(bound, new)
    bound(torch.zeros(1))
    bind(bound, None)
    bound(torch.zeros(1))
    assert plain.seen == [None] and bound.seen == [new, None]


def test_an_exception_in_forward_leaves_no_handle_current():
    class Failing(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = Failing()
    bind(model, handle("ring"))
    try:
        model(torch.zeros(1))
    except RuntimeError:
        pass
    assert current() is None
    with using(handle("ulysses")) as cp:
        assert current() is cp
    assert current() is None
