"""The RFC's own scenarios on a GPU. Skipped without CUDA (CI has none); run them on a device machine."""

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from _metrics import Gram, LastSeenFirst, SeesAll, SeesLayout, assert_same_values, made_in_inference_mode
from _support import LoggingModel, assert_same, loader, stored_tensors
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix

from lightning_store import StoreOnCPUMixin, StoreOnCPUWarning, offload_to_cpu, store_states_on_cpu
from lightning_store._logged.result import _StoredOnCPU
from lightning_store._selfcheck._fits import MemoryLogger

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def gpu_trainer_kwargs(quiet_trainer_kwargs):
    yield {**quiet_trainer_kwargs, "accelerator": "gpu", "max_epochs": 2}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _SyncedLoggingModel(LoggingModel):
    """``LoggingModel`` with ``sync_dist=True`` on every call."""

    def log(self, *args, **kwargs):
        super().log(*args, sync_dist=True, **kwargs)

    def on_train_start(self):
        self.backend = torch.distributed.get_backend()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.store:  # a CPU tensor with sync_dist: Lightning alone hands it to NCCL (Lightning #18803)
            self.log("cpu_value", loss.detach().cpu(), store_on_cpu=True)
        return loss


def _fit_and_validate(store_on_cpu, trainer_kwargs, strategy="auto", model_class=LoggingModel):
    torch.manual_seed(0)
    model = model_class(store_on_cpu=store_on_cpu)
    trainer = pl.Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model, loader(), [loader(seed=1), loader(n=7, seed=2)])
    seen = {"callback": dict(trainer.callback_metrics), "logged": dict(trainer.logged_metrics)}
    return trainer, model, seen


def _assert_close(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key].cpu(), b[key].cpu(), rtol=1e-6, atol=0, equal_nan=True, msg=key)


def test_state_lives_on_the_cpu_while_the_model_is_on_the_gpu(gpu_trainer_kwargs):
    _, plain_model, on_device = _fit_and_validate(False, gpu_trainer_kwargs)
    _, model, on_cpu = _fit_and_validate(True, gpu_trainer_kwargs)
    assert model.model_devices == plain_model.model_devices == {"cuda"}
    # checked after every call: every tensor kept for every key was on the CPU
    assert {"training_step.train_mean_11", "validation_step.val_sum_01.1"} <= model.checked_keys
    assert model.callback_devices == {"cpu"} and "cuda" in plain_model.callback_devices
    for what in on_device:
        _assert_close(on_device[what], on_cpu[what])


def test_ddp_on_one_gpu_with_nccl_syncs_on_the_device_and_stores_on_the_cpu(gpu_trainer_kwargs):
    """The RFC's bug: the epoch-end reduction ran on CPU tensors ("Tensors must be CUDA and dense")."""
    _, _, on_device = _fit_and_validate(False, gpu_trainer_kwargs, "ddp", _SyncedLoggingModel)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    trainer, model, on_cpu = _fit_and_validate(True, gpu_trainer_kwargs, "ddp", _SyncedLoggingModel)
    assert model.backend == "nccl"
    results = trainer.fit_loop.epoch_loop._results
    assert all(result._sync_runs for result in results.values())
    assert all(isinstance(result, _StoredOnCPU) for result in results.values())
    for what in on_device:
        cpu_value = on_cpu[what].pop("cpu_value")
        assert cpu_value.item() == pytest.approx(on_cpu[what]["train_loss"].item(), rel=1e-6)
        _assert_close(on_device[what], on_cpu[what])


class DummyMetric(torchmetrics.Metric):
    """The RFC's metric: a sum that fails on a device mismatch."""

    def __init__(self):
        super().__init__()
        self.add_state("x", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x):
        self.x += x

    def compute(self):
        return self.x


class _RFCModel(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.metric = DummyMetric()
        self.total = 0

    def training_step(self, batch, batch_idx):
        value = (batch[0].abs().sum() * 100).long()
        self.total += int(value)
        self.metric(value)
        self.log("train_loss_2", self.metric, on_epoch=True, store_on_cpu=True)
        self.log("loss", self.layer(batch[0]).sum(), store_on_cpu=True)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_rfcs_dummy_metric_warns_and_keeps_working_on_the_gpu(gpu_trainer_kwargs):
    gpu_trainer_kwargs["max_epochs"] = 1
    model = _RFCModel()
    trainer = pl.Trainer(**gpu_trainer_kwargs)
    with pytest.warns(StoreOnCPUWarning, match="a `torchmetrics.Metric` keeps its state on its own device"):
        trainer.fit(model, loader())
    assert model.metric.x.device.type == "cuda"  # never moved: its next `update` would have failed
    assert trainer.callback_metrics["train_loss_2_epoch"].item() == model.total
    assert trainer.callback_metrics["loss"].device.type == "cpu"


def test_logging_adds_no_host_device_sync_after_the_first_step(gpu_trainer_kwargs):
    class Model(_RFCModel):
        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).sum()
            if batch_idx > 0:
                torch.cuda.set_sync_debug_mode("error")
            try:
                self.log("loss", loss, store_on_cpu=True, batch_size=4)
                self.log("mean", loss * 2, store_on_cpu=True, on_step=False, on_epoch=True, batch_size=4)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            result = self.trainer._results["training_step.mean"]
            assert all(t.device.type == "cpu" for t in stored_tensors(result))
            return loss

    trainer = pl.Trainer(**gpu_trainer_kwargs)
    trainer.fit(Model(), loader(n=40))
    assert trainer.callback_metrics["mean"].device.type == "cpu"


# The copies of a value and the in-place changes made right after the call wait together behind this much GPU
# work, then start at once: without an ordering between them, the change reaches the copy (issue 18).
_BUSY_CYCLES = 2_000_000  # of `torch.cuda._sleep`: about a millisecond


class _ChangedInPlaceModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs a fresh tensor and a module buffer every step, then changes both in place at once."""

    def __init__(self, store_on_cpu):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.register_buffer("running", torch.zeros(()))
        self.store = store_on_cpu

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        value = loss.detach() + batch_idx
        self.running.add_(x.sum())  # the buffer changes in place on every step
        torch.cuda._sleep(_BUSY_CYCLES)
        # "max": the epoch value is exact on any device, so every logged value compares bit for bit
        for name, tensor in (("value", value), ("running", self.running)):
            self.log(name, tensor, reduce_fx="max", on_step=True, on_epoch=True, store_on_cpu=self.store)
        value.zero_()
        self.running.mul_(0.5)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_logged_value_changed_in_place_at_once_is_logged_as_it_was_at_the_call(gpu_trainer_kwargs):
    seen = []
    for store_on_cpu in (False, True):
        torch.manual_seed(0)
        logger = MemoryLogger()
        trainer = pl.Trainer(**{**gpu_trainer_kwargs, "logger": logger, "log_every_n_steps": 1})
        trainer.fit(_ChangedInPlaceModel(store_on_cpu), loader(n=400))  # 2 epochs of 100 steps
        seen.append((logger.history, dict(trainer.callback_metrics)))
    (plain_history, plain_callback), (history, callback) = seen
    assert len(history) >= 200 and history == plain_history  # every step's values, as floats: bit for bit
    assert_same(plain_callback, callback)  # both moved to the CPU by Lightning's teardown


def test_a_list_state_element_changed_in_place_after_update_is_kept_as_it_was():
    """``LastSeenFirst`` keeps each item itself as its list-state element, as ``CatMetric`` keeps its input.

    A plain Metric on the GPU would see the change through that element; a configured one keeps the item as it was
    at ``update``, as ``compute_on_cpu=True`` does: the oracle is the plain Metric fed a copy taken then.
    """
    configured = store_states_on_cpu(LastSeenFirst()).cuda()
    plain = LastSeenFirst().cuda()
    generator = torch.Generator("cuda").manual_seed(0)
    for step in range(50):
        item = torch.randn(2**20, device="cuda", generator=generator)  # 4 MiB: a copy long enough to race
        plain.update([item.clone()])
        torch.cuda._sleep(_BUSY_CYCLES)
        configured.update([item])
        if step % 2:
            item.mul_(-2)
        else:
            item.zero_()
    assert len(configured.items) == 50
    got = configured.compute()
    assert all(t.is_cpu for t in configured.items)
    assert torch.equal(got, plain.compute().cpu())


class _PlainOnTheGPU(pl.LightningModule):
    """A module without the mixin, as a Lightning 1.x project has them, with a Metric that keeps its predictions."""

    def __init__(self, count_syncs):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = torchmetrics.classification.BinaryAUROC(thresholds=None)
        self.count_syncs = count_syncs
        self.devices = set()

    def training_step(self, batch, batch_idx):
        scores = self.layer(batch[0]).squeeze(1)
        loss = scores.pow(2).mean()
        self.auroc.update(scores.sigmoid(), (batch[0][:, 0] > 0).long())  # torchmetrics' own checks sync
        if self.count_syncs and batch_idx > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            self.log("loss", loss, batch_size=4)
            self.log("mean", loss * 2, on_step=False, on_epoch=True, batch_size=4)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for name in ("loss", "mean"):
            self.devices.update(t.device.type for t in stored_tensors(self.trainer._results[f"training_step.{name}"]))
        return loss

    def on_train_epoch_end(self):
        self.devices.update(t.device.type for t in self.auroc.preds)
        self.log("auroc", self.auroc.compute())
        self.auroc.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_flag_keeps_a_plain_modules_state_on_the_cpu_without_a_host_sync_in_self_log(gpu_trainer_kwargs):
    import warnings

    from lightning_store import StoreOnCPUDeprecationWarning, Trainer

    seen = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = _PlainOnTheGPU(count_syncs=flag)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
            trainer = Trainer(**gpu_trainer_kwargs, move_metrics_to_cpu=flag)
        trainer.fit(model, loader(n=40))
        # under the flag every logged key's state and the AUROC's predictions are on the CPU; plainly, on the GPU
        assert model.devices == ({"cpu"} if flag else {"cuda"})
        seen[flag] = dict(trainer.callback_metrics)
    _assert_close(seen[False], seen[True])


# offload_to_cpu on the GPU: the oracle is the plain Metric on the CPU, fed CPU copies of the same inputs.


def _metric_tensors(metric):
    """Every tensor a Metric holds: its states (each list element), their defaults and its buffers (thresholds)."""
    held = list(metric.buffers())
    for name, default in metric._defaults.items():
        for value in (getattr(metric, name), default):  # reading a state waits for the updates queued
            held.extend(value if isinstance(value, list) else [value])
    return held


class _OffloadedAUROCModel(pl.LightningModule):
    """Updates an offloaded ``BinaryAUROC`` every step, logged as a Metric object; keeps CPU copies of its inputs."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = offload_to_cpu(BinaryAUROC(thresholds=200), worker="thread")
        self.inputs = []  # one list per epoch: each step's (preds, target), copied to the CPU
        self.model_devices, self.state_devices, self.metric_devices = set(), set(), set()

    def on_train_epoch_start(self):
        self.inputs.append([])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        scores = self.layer(x).squeeze(1)
        preds, target = scores.detach().sigmoid(), (x[:, 0] > 0).long()
        self.auroc.update(preds, target)
        self.inputs[-1].append((preds.cpu(), target.cpu()))
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        self.model_devices.update({self.layer.weight.device.type, x.device.type})
        return scores.pow(2).mean()

    def on_train_batch_end(self, *args):
        self.state_devices.update(t.device.type for t in _metric_tensors(self.auroc))
        self.metric_devices.add(self.auroc.device.type)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_offloaded_metric_in_a_gpu_fit_keeps_its_states_on_the_cpu_and_logs_the_plain_cpu_value(
    gpu_trainer_kwargs,
):
    torch.manual_seed(0)
    model, logger = _OffloadedAUROCModel(), MemoryLogger()
    trainer = pl.Trainer(**{**gpu_trainer_kwargs, "logger": logger})
    trainer.fit(model, loader(n=40))  # 2 epochs of 10 steps
    assert model.model_devices == {"cuda"}
    assert model.state_devices == model.metric_devices == {"cpu"}  # after every step
    plain_values = []
    for epoch in model.inputs:
        plain = BinaryAUROC(thresholds=200)
        for preds, target in epoch:
            plain.update(preds, target)
        plain_values.append(plain.compute())
    assert [len(epoch) for epoch in model.inputs] == [10, 10]
    logged = [metrics["auroc"] for _, metrics in logger.history if "auroc" in metrics]  # one per epoch
    assert [float(value) for value in logged] == [float(value) for value in plain_values]  # bit for bit
    callback = trainer.callback_metrics["auroc"]
    assert callback.dtype == plain_values[-1].dtype and torch.equal(callback.cpu(), plain_values[-1])


def _offload_batches(count, seed=0):
    """``count`` batches of inputs on the GPU, by Metric: a list-state AUROC and a confusion matrix."""
    generator = torch.Generator("cuda").manual_seed(seed)
    batches = []
    for _ in range(count):
        logits = torch.randn(64, 5, device="cuda", generator=generator)
        target = torch.randint(5, (64,), device="cuda", generator=generator)
        batches.append({"auroc": (logits[:, 0].sigmoid(), (target == 0).long()), "confmat": (logits, target)})
    return batches


def _offload_metrics():
    return {"auroc": BinaryAUROC(thresholds=None), "confmat": MulticlassConfusionMatrix(num_classes=5)}


def test_an_offloaded_metrics_update_makes_no_host_sync_after_the_first():
    metrics = {name: offload_to_cpu(metric, worker="thread") for name, metric in _offload_metrics().items()}
    batches = _offload_batches(30)
    for step, batch in enumerate(batches):
        for name, metric in metrics.items():
            if step:  # the first update makes the pinned buffers and starts the worker
                torch.cuda.set_sync_debug_mode("error")
            try:
                metric.update(*batch[name])
            finally:
                torch.cuda.set_sync_debug_mode("default")
    plain = _offload_metrics()
    for batch in batches:
        for name, inputs in batch.items():
            plain[name].update(*(tensor.cpu() for tensor in inputs))
    for name, metric in metrics.items():
        assert torch.equal(metric.compute(), plain[name].compute()), name  # an update that raised would raise here
        assert all(t.is_cpu for t in _metric_tensors(metric)), name


def test_an_input_changed_in_place_right_after_an_offloaded_update_is_taken_as_it_was():
    """``CatMetric`` keeps each input as its list-state element: a change that reached the copy would show."""
    metric, plain = offload_to_cpu(torchmetrics.CatMetric(), worker="thread"), torchmetrics.CatMetric()
    generator = torch.Generator("cuda").manual_seed(0)
    for step in range(50):
        x = torch.randn(2**20, device="cuda", generator=generator)  # 4 MiB: a copy long enough to race
        plain.update(x.to("cpu", copy=True))  # the values as they are at the offloaded update
        torch.cuda._sleep(_BUSY_CYCLES)  # the copy waits behind this, then would race the change made below
        metric.update(x)
        if step % 2:
            x.add_(1)
        else:
            x.zero_()
    assert torch.equal(metric.compute(), plain.compute())


@pytest.mark.parametrize(
    ("make", "fed"),
    [
        (lambda: BinaryAUROC(thresholds=None), "auroc"),  # list states
        (lambda: BinaryAUROC(thresholds=200), "auroc"),  # a tensor state, and the thresholds as a buffer
        (lambda: MulticlassConfusionMatrix(num_classes=5), "confmat"),
    ],
    ids=["list states", "binned", "confusion matrix"],
)
def test_cuda_on_an_offloaded_metric_keeps_its_states_on_the_cpu(make, fed):
    (batch,) = _offload_batches(1)
    inputs = batch[fed]
    metric, plain = offload_to_cpu(make(), worker="thread"), make()
    metric.update(*inputs)  # a state to move
    assert metric.cuda() is metric
    metric.to("cuda")
    assert metric.device == torch.device("cpu")
    assert {t.device.type for t in _metric_tensors(metric)} == {"cpu"}
    metric.update(*inputs)  # inputs on the GPU, after the move
    for _ in range(2):
        plain.update(*(tensor.cpu() for tensor in inputs))
    value = metric.compute()
    assert value.is_cpu and torch.equal(value, plain.compute())
    assert {t.device.type for t in _metric_tensors(metric)} == {"cpu"}


def test_a_pinned_buffer_made_in_inference_mode_serves_a_copy_outside_it():
    from lightning_store._buffer import _CUDATransfer

    transfer = _CUDATransfer(torch.device("cuda", torch.cuda.current_device()))
    with torch.inference_mode():  # an evaluation loop makes the buffer
        copy = transfer.start(torch.ones(3, device="cuda"))
        copy.wait()
        copy.release()
    value = torch.full((3,), 2.0, device="cuda")  # the training loop reuses it
    for snapshot in (False, True):
        copy = transfer.start(value, snapshot=snapshot)
        assert torch.equal(copy.wait(), value.cpu())
        copy.release()


def test_an_offloaded_update_under_cuda_autocast_gives_the_plain_cpu_value():
    """CUDA's autocast is carried into the worker, where it leaves CPU ops as they are: as in the plain CPU run."""
    generator = torch.Generator("cuda").manual_seed(0)
    batches = [torch.randn(64, 4, device="cuda", generator=generator) for _ in range(3)]
    metric, plain = offload_to_cpu(Gram(), worker="thread"), Gram()
    both = offload_to_cpu(Gram(), worker="thread"), Gram()  # CUDA's and the CPU's autocast at once
    for x in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            metric.update(x)
            plain.update(x.cpu())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                both[0].update(x)
                both[1].update(x.cpu())
    assert torch.equal(metric.compute(), plain.compute())
    assert torch.equal(both[0].compute(), both[1].compute())
    assert not torch.equal(plain.compute(), both[1].compute())  # the CPU's autocast changed the plain value


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.T,
        lambda x: x.view(2, 4, 8, 8).to(memory_format=torch.channels_last),
        lambda x: x[:, ::2],
        lambda x: x[:1].expand(16, 32),
    ],
    ids=["transposed", "channels_last", "every other column", "expanded"],
)
def test_an_input_on_the_gpu_lands_with_the_layout_tensor_cpu_gives(make):
    x = make(torch.randn(16, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(0)))
    metric, plain = offload_to_cpu(SeesLayout(), worker="thread"), SeesLayout()
    for _ in range(2):  # the second copy goes through a pinned buffer the first handed back
        metric.update(x)
        plain.update(x.cpu())
    assert torch.equal(metric.compute(), plain.compute())


def _complex_on_gpu():
    return torch.complex(torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda"))


@pytest.mark.parametrize("worker", ["thread", "process"])
@pytest.mark.parametrize(
    ("make", "in_inference_mode"),
    [
        (lambda: _complex_on_gpu().conj(), False),
        (lambda: _complex_on_gpu().conj().imag, False),
        (lambda: made_in_inference_mode(lambda: torch.randn(16, 32, device="cuda")), False),
        (lambda: torch.randn(16, 32, device="cuda"), True),
    ],
    ids=["conjugate view", "negative view", "made in inference mode", "passed in inference mode"],
)
def test_an_input_on_the_gpu_lands_with_the_flags_tensor_cpu_gives(make, in_inference_mode, worker):
    x = make()
    metric, plain = offload_to_cpu(SeesAll(), worker=worker), SeesAll()
    with torch.inference_mode(in_inference_mode):
        metric.update(x)
        plain.update(x.cpu())
    assert_same_values(metric.compute(), plain.compute())


def test_a_draw_from_the_cuda_generator_is_refused():
    class DrawsOnCUDA(torchmetrics.SumMetric):
        def update(self, value):
            super().update(value + torch.rand((), device="cuda").cpu())

    metric = offload_to_cpu(DrawsOnCUDA(), worker="thread")
    state = torch.cuda.get_rng_state()
    metric.update(torch.ones(3, device="cuda"))
    with pytest.raises(RuntimeError, match=r"from torch's global CUDA generator \(aten\.rand\.default\)"):
        metric.compute()
    assert torch.equal(torch.cuda.get_rng_state(), state)
