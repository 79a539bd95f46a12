"""The worker refuses, at any update, a draw from torch's global generators and an op under another default dtype."""

import threading

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import SumMetric

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.thread.worker import _thread_worker


class Subsamples(SumMetric):
    """Sums at most 8 values of each batch, drawn at random (``torch.randperm``) from a larger one."""

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def update(self, value: Tensor) -> None:
        if value.numel() > 8:
            value = value[torch.randperm(value.numel(), generator=self.generator)[:8]]
        super().update(value)


def _batches() -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(size, generator=generator) for size in (4, 20, 20)]  # a small first batch draws nothing


class _WaitsFor(SumMetric):
    """Its ``update`` waits for ``gate``: offloaded, it holds the worker thread, which runs every Metric's updates."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate = gate

    def update(self, value: Tensor) -> None:
        self.gate.wait(timeout=60)
        super().update(value)


def test_a_draw_after_the_first_update_is_refused_before_it_moves_the_generator():
    metric = offload_to_cpu(Subsamples(), worker="thread")
    torch.manual_seed(0)
    state = torch.get_rng_state()
    gate = threading.Event()
    offload_to_cpu(_WaitsFor(gate), worker="thread").update(
        torch.tensor(0.0)
    )  # every update below stays queued until the gate opens
    for batch in _batches():
        metric.update(batch)
    gate.set()
    _thread_worker().quiesce()
    assert torch.equal(torch.get_rng_state(), state)  # the worker drew nothing
    with pytest.raises(RuntimeError) as err:
        metric.compute()
    assert str(err.value) == (
        "Subsamples.update raised in lightning-store's offload worker, at update #2 since offload_to_cpu: it was"
        " about to draw random numbers from torch's global CPU generator (aten.randperm.generator), and was stopped"
        " before it drew. Run in the background, it would draw them at another time than the plain Metric,"
        " changing both its values and the random numbers your model draws. The Metric's state holds what the"
        " update changed before it. The 1 update(s) queued after it were not run, as the calls after a raising"
        " `update` would not have been. HINT: keep this Metric as it is (not offloaded), or give its update a"
        " `torch.Generator` of its own, seeded once."
    )


def test_a_metric_with_a_generator_of_its_own_gives_the_plain_values():
    plain = Subsamples(torch.Generator().manual_seed(1))
    offloaded = offload_to_cpu(Subsamples(torch.Generator().manual_seed(1)), worker="thread")
    for batch in _batches():
        plain.update(batch)
        offloaded.update(batch)
    assert torch.equal(offloaded.compute(), plain.compute())


class DrawsWith(SumMetric):
    """Adds the sum of ``draw(x)``: an op that may or may not draw random numbers, by its arguments."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def update(self, x: Tensor) -> None:
        super().update(self.draw(x).sum())


def _attention(dropout_p: float):
    return lambda x: F.scaled_dot_product_attention(*[x.view(1, 2, 3)] * 3, dropout_p=dropout_p)


DRAWS_NOTHING = {
    "dropout, training=False": lambda x: F.dropout(x, 0.5, training=False),
    "dropout, p=0": lambda x: F.dropout(x, 0.0),
    "a dropout layer in eval mode": lambda x: torch.nn.Dropout(0.5).eval()(x),
    "attention without dropout": _attention(0.0),
    "rrelu, training=False": lambda x: F.rrelu(x, training=False),
    "rand with a generator of its own": lambda x: x + torch.rand(6, generator=torch.Generator().manual_seed(0)),
}
DRAWS = {  # the op, and the aten op refused (a pattern)
    "dropout": (lambda x: F.dropout(x, 0.5), r"aten\.bernoulli_\.float"),
    "attention with dropout": (_attention(0.5), r"aten\.bernoulli_\.float|aten\.\w*attention\w*\.\w+"),
    "rand": (lambda x: x + torch.rand(6), r"aten\.rand\.default"),
    "normal_": (lambda x: x.clone().normal_(), r"aten\.normal_\.default"),
    "multinomial": (lambda x: torch.multinomial(x.abs() + 1, 2).float(), r"aten\.multinomial\.default"),
    "the global generator, named": (
        lambda x: x + torch.rand(6, generator=torch.default_generator),
        r"aten\.rand\.generator",
    ),
}


@pytest.mark.parametrize("op", DRAWS_NOTHING)
def test_an_op_that_draws_nothing_runs(op):
    plain, offloaded = DrawsWith(DRAWS_NOTHING[op]), offload_to_cpu(DrawsWith(DRAWS_NOTHING[op]), worker="thread")
    x = torch.linspace(-1, 1, 6)
    for m in (plain, offloaded):
        m.update(x)
    assert torch.equal(offloaded.compute(), plain.compute())


@pytest.mark.parametrize("op", DRAWS)
def test_an_op_that_draws_from_a_global_generator_is_refused(op):
    draw, name = DRAWS[op]
    metric = offload_to_cpu(DrawsWith(draw), worker="thread")
    state = torch.get_rng_state()
    metric.update(torch.linspace(-1, 1, 6))
    with pytest.raises(RuntimeError, match=f"from torch's global CPU generator \\(({name})\\), and was stopped"):
        metric.compute()
    assert torch.equal(torch.get_rng_state(), state)


def test_an_op_run_under_another_default_dtype_is_refused():
    gate = threading.Event()

    class Waits(SumMetric):
        def update(self, x: Tensor) -> None:
            gate.wait()
            super().update(x + torch.tensor(1.0))  # a tensor of the default dtype

    metric = offload_to_cpu(Waits(), worker="thread")
    metric.update(torch.ones(2))  # called under float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as Lightning's "64-true" precision around a step
    try:
        gate.set()
        _thread_worker().quiesce()
    finally:
        torch.set_default_dtype(default)
    with pytest.raises(RuntimeError, match=r"at update #1 since offload_to_cpu: torch's default dtype was") as err:
        metric.compute()
    assert "torch.float64 when it was about to run" in str(err.value)
    assert "but torch.float32 when `update` was called" in str(err.value)
    assert str(err.value).endswith("or do not change the default dtype while offloaded updates run.")


class DropoutModel(pl.LightningModule):
    """Dropout in the step, and a Metric updated in it: the model's masks must be the plain run's."""

    def __init__(self, metric: SumMetric):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 8)
        self.metric = metric
        self.masks: list[Tensor] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out = F.dropout(self.layer(x), 0.5)
        self.masks.append(out.detach() == 0)
        self.metric.update(out.detach().flatten())
        self.log("sum", self.metric, on_step=False, on_epoch=True)
        return out.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(metric, quiet_trainer_kwargs):
    model = DropoutModel(metric)
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=2)
    data = torch.rand(16, 8, generator=torch.Generator().manual_seed(1))
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=4))
    return model, trainer


def test_a_fit_keeps_the_models_random_numbers(quiet_trainer_kwargs):
    generator = torch.Generator()
    plain, _ = _fit(Subsamples(generator.manual_seed(2)), quiet_trainer_kwargs)
    offloaded, trainer = _fit(
        offload_to_cpu(Subsamples(generator.manual_seed(2)), worker="thread"), quiet_trainer_kwargs
    )
    assert all(torch.equal(a, b) for a, b in zip(plain.masks, offloaded.masks, strict=True))
    assert torch.equal(offloaded.layer.weight, plain.layer.weight)
    assert torch.equal(trainer.callback_metrics["sum"], plain.trainer.callback_metrics["sum"])


def test_a_fit_with_a_metric_drawing_from_the_global_generator_fails_with_the_hint(quiet_trainer_kwargs):
    with pytest.raises(RuntimeError, match=r"Subsamples.update raised .* torch's global CPU generator .* HINT: keep"):
        _fit(offload_to_cpu(Subsamples(), worker="thread"), quiet_trainer_kwargs)
