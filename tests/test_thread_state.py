"""What an offloaded update carries into the worker from its caller's thread: the plain Metric's values, bit for bit."""

import contextlib

import pytest
import pytorch_lightning as pl
import torch
from _metrics import Gram
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric
from torchmetrics.image import StructuralSimilarityIndexMeasure
from torchmetrics.utilities.data import dim_zero_cat

from lightning_store import offload_to_cpu
from lightning_store._selfcheck._fits import MemoryLogger
from lightning_store.metrics._offload.thread.worker import _thread_worker


def _cpu_autocast() -> tuple[bool, bool]:
    """Whether autocast is on for the CPU, and whether its dtype is float16."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu") == torch.float16
    return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype() == torch.float16


class SeesThreadState(Metric):
    """Keeps, at each update, what torch's thread-local state is where the update runs."""

    def __init__(self):
        super().__init__()
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, x: Tensor) -> None:
        self.seen.append(
            torch.tensor(
                [
                    torch.is_grad_enabled(),
                    torch.is_inference_mode_enabled(),
                    *_cpu_autocast(),
                    torch.is_autocast_cache_enabled(),
                    torch.get_num_threads(),
                    float(x.sum() == 0),  # a subnormal flushed to zero (`torch.set_flush_denormal`)
                ],
                dtype=torch.float64,
            )
        )

    def compute(self) -> Tensor:
        return dim_zero_cat(self.seen)


def _images(seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    preds = torch.rand(2, 3, 32, 32, generator=generator)
    return preds, (preds + 0.05 * torch.rand(2, 3, 32, 32, generator=generator)).clamp(0, 1)


def _run(make, batches, context):
    """The plain and the offloaded Metric updated in ``context()``, and both computed outside it."""
    plain, offloaded = make(), offload_to_cpu(make(), worker="thread")
    for batch in batches:
        with context():
            plain.update(*batch)
            offloaded.update(*batch)
    return plain.compute(), offloaded.compute()


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_an_update_under_cpu_autocast_gives_the_plain_value():
    batches = [_images(seed) for seed in range(3)]
    plain, offloaded = _run(lambda: StructuralSimilarityIndexMeasure(data_range=1.0), batches, _bf16)
    assert torch.equal(offloaded, plain)
    full, _ = _run(lambda: StructuralSimilarityIndexMeasure(data_range=1.0), batches, contextlib.nullcontext)
    assert not torch.equal(plain, full)  # autocast changes it: the test would see a value computed without it


def test_a_matmul_under_cpu_autocast_gives_the_plain_state():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 4, generator=generator),) for _ in range(4)]
    plain, offloaded = _run(Gram, batches, _bf16)
    assert torch.equal(offloaded, plain)
    full, _ = _run(Gram, batches, contextlib.nullcontext)
    assert not torch.equal(plain, full)


SUBNORMAL = torch.tensor([1e-40])  # float32: flushed to zero with `torch.set_flush_denormal(True)`


@contextlib.contextmanager
def _flush_subnormals():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal numbers to zero")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


CONTEXTS = {
    "none": contextlib.nullcontext,
    # grad mode is carried too, but torchmetrics sets its own in `update` (`Metric._enable_grad`)
    "inference_mode": torch.inference_mode,
    "autocast bf16": _bf16,
    "autocast fp16, no cache": lambda: torch.autocast("cpu", dtype=torch.float16, cache_enabled=False),
    "autocast bf16 inside autocast fp16, no cache": lambda: _nested(
        torch.autocast("cpu", dtype=torch.float16, cache_enabled=False), _bf16()
    ),
    "flush subnormals": _flush_subnormals,
    "one torch thread": _one_thread,
}


@contextlib.contextmanager
def _nested(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


@pytest.mark.parametrize("context", CONTEXTS)
def test_each_piece_of_thread_state_is_carried(context):
    plain, offloaded = _run(SeesThreadState, [(SUBNORMAL,)] * 2, CONTEXTS[context])
    assert torch.equal(offloaded, plain)
    if context != "none":  # the context changes what the update sees
        assert not torch.equal(plain, _run(SeesThreadState, [(SUBNORMAL,)] * 2, contextlib.nullcontext)[0])


def test_the_worker_is_left_as_it_was_after_an_update():
    metric = offload_to_cpu(SeesThreadState(), worker="thread")
    with _bf16(), _flush_subnormals(), torch.no_grad():
        metric.update(SUBNORMAL)
    metric.update(SUBNORMAL)
    first, second = metric.compute().view(2, -1)
    assert first[2] == 1 and first[6] == 1  # autocast on, subnormals flushed
    assert second[2] == 0 and second[6] == 0  # both back as they were


def test_thread_state_it_cannot_carry_fails_the_update_with_a_hint():
    metric = offload_to_cpu(Gram(), worker="thread")
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate)
    with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.Conjugate):
        metric.update(torch.ones(2, 4))
    _thread_worker().quiesce()
    with pytest.raises(RuntimeError, match=r"^Gram.update raised in .* at update #1 since offload_to_cpu") as err:
        metric.compute()
    message = str(err.value)
    assert f"the dispatch keys {keys} differ from the caller's" in message
    assert message.endswith("HINT: call `update` outside that context, or keep this Metric as it is (not offloaded).")


class ImagesModel(pl.LightningModule):
    """Logs SSIM and a matmul Metric of its own outputs: under a mixed precision, the step runs in autocast."""

    def __init__(self, offload: bool):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.ssim = StructuralSimilarityIndexMeasure(data_range=1.0)
        self.gram = Gram()
        if offload:
            offload_to_cpu(self.ssim, worker="thread")
            offload_to_cpu(self.gram, worker="thread")

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out = self.layer(x).sigmoid()
        images = out.detach().float()  # float32 into the Metrics: autocast is what runs their ops in bf16
        self.ssim.update(images, x)
        self.gram.update(images.flatten(1)[:, :4])
        self.log("ssim", self.ssim, on_step=False, on_epoch=True)
        self.log("gram", self.gram.compute().sum(), on_step=True)
        return (out - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(offload: bool, precision: str, quiet_trainer_kwargs) -> list:
    logger = MemoryLogger()
    trainer = pl.Trainer(
        **{**quiet_trainer_kwargs, "logger": logger}, max_epochs=2, precision=precision, log_every_n_steps=1
    )
    images = torch.rand(12, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    trainer.fit(ImagesModel(offload), DataLoader(TensorDataset(images), batch_size=4))
    return logger.history


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])  # "16-mixed" on the CPU: Lightning runs bf16
@pytest.mark.filterwarnings("ignore:You passed `Trainer\\(accelerator='cpu', precision='16-mixed'\\)`")
def test_a_fit_in_mixed_precision_logs_the_plain_values(precision, quiet_trainer_kwargs):
    plain = _fit(False, precision, quiet_trainer_kwargs)
    assert _fit(True, precision, quiet_trainer_kwargs) == plain
    assert _fit(False, "32-true", quiet_trainer_kwargs) != plain  # the precision changes what is logged
