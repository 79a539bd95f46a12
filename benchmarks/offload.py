"""What ``offload_to_cpu`` saves the caller: ``update`` time, a training loop's wall time, a tiny Metric, a GPU step.

Every figure is a ratio, offloaded to plain, measured side by side in one run: the ways run in a shuffled order in
each round, each round gives one ratio, and the script prints the median ratio over rounds with its interquartile
range (the machine's noise). Each part runs in a Python process of its own (see ``run_part_apart``), which first
allocates and frees 30 MiB (lightning-store's ``_keep_freed_memory``, as its worker process does), as a training
process has freed something large before its steps: no part's figures depend on the parts run before it; part 5
runs each way of each Metric in a process of its own too. Each runs at ``--threads`` intra-op threads (default 1;
the worker thread of ``offload_to_cpu`` uses the same number). Every offloaded Metric's value is checked equal
(``torch.equal``) to that of the same Metric run plainly on the same inputs; a mismatch is printed and the script
exits with 1.

1. CPU, heavy Metric: the caller's time in ``update`` for ``BinaryAUROC(thresholds=200)`` and
   ``MulticlassConfusionMatrix(num_classes=1000)`` at 100,000 and 1,000,000 predictions per batch, against the
   plain ``update``, with each worker. Each round makes ``--calls`` calls: the offloaded Metric has room for all
   of them (``max_pending=calls``), and its updates are waited for after them, outside the timed region; the
   figure is the median call. Reported apart: the queue full (``max_pending=1``), where every call after the
   first waits for the worker (backpressure: the bound does not change that steady state, only how many calls
   pass before it), and the worker's time per update (the burst until its last update has run, over the calls;
   the states are read back once, at the end, as a fit reads them once an epoch). The first ``update`` of an
   offloaded Metric starts the worker; it is reported in the notes.
   Goal: at most 0.05 with room in the queue.
2. CPU, a training loop: a small MLP's forward, backward and SGD step, with ``BinaryAUROC(thresholds=200)`` updated
   on its predictions after the forward; sizes such that the update is a third to a half of the inline step (on
   2-CPU machines; the notes give it). The loop's wall time, ``compute`` at the end included, offloaded (default
   ``max_pending``) against inline. With one thread for the model, the worker has the second core to itself. The
   notes give the step without ``update`` both ways: the worker shares the process (the GIL, the allocator) with it.
   Goal: at most 0.75, and 0.85 in every round.
3. CPU, a tiny Metric: ``MeanMetric`` of a scalar, µs per ``update`` plain and offloaded, the caller's and in all
   (the updates and ``compute``, which waits for the worker): what offloading costs where there is nothing to save.
4. CPU, what the worker adds around each update, whatever the Metric: the caller's torch state applied, the guard
   that refuses a draw from a global torch generator (a dispatch mode: a cost per op the update runs), its warnings
   kept, Python's and NumPy's generators compared. An update's time as the worker runs it against the plain
   ``update``, both in the main thread, for Metrics of few large ops, many small ops, and a tiny one. No goal: it
   is time in the worker, off the caller, and costs the step only where the worker falls behind.
5. CPU, a launch-bound step: the training thread runs ``LAUNCH_OPS`` small ops a step (dispatcher-bound, as a host
   launching a GPU's kernels is), and updates a Metric whose update costs less than the step: a binned AUROC of
   1,000 predictions, a confusion matrix of 1,000 classes, and Metrics that run Python in ``update`` (word error
   rate, ROUGE; detection mAP where ``faster-coco-eval`` is installed). The binned AUROC and the confusion matrix
   also beside the training step of a deep, narrow MLP (``MODEL_LAYERS`` layers, 4 samples), as long, whose
   weights, gradients and activations (0.8 MB) share the cores' common cache with the update run on the other
   core. The time per step over ``LAUNCH_STEPS`` steps, the worker's queue waited
   for at the end, with the Metric inline, in a worker thread and in a worker process, against the step with no
   Metric; each way in a process of its own (the step without a Metric ran slower beside the others in one
   process), each measure after ``WARM_UP_STEPS`` steps of its own, untimed. Reading the states back from the
   worker process (once an epoch in a fit) is reported apart. Goal: at most 1.10 offloaded; for a step shorter
   than the update, at most 0.75 of inline (the notes give the update's own share of the inline step, about what
   a step that waits for the worker comes to).
6. GPU (only with CUDA): (a) the host syncs per ``update`` of an offloaded ``BinaryAUROC(thresholds=200)`` fed
   CUDA tensors, counted with ``torch.cuda.set_sync_debug_mode("warn")`` by the thread that made them, the first
   update apart (it makes the pinned buffers); (b) the device bytes of its states; (c) a launch-bound CUDA step
   (``GPU_OPS`` small kernels) with an offloaded ``BinaryAUROC(thresholds=200)`` of 10,000 predictions against
   the same step without a Metric, the device synchronised around each timed loop only. Goals: 0 syncs per update
   after the first, 0 device bytes, a step ratio of at most 1.02. Both workers.

The parts' code is in ``offload_parts/``: parts 1 and 2 in ``saves.py``, 3 and 4 in ``costs.py``, 5 in ``launch.py``,
6 in ``gpu.py``, and the rows, the table and the goals in ``report.py``.

    python benchmarks/offload.py [--rounds 9] [--calls 5] [--threads 1] [--parts heavy loop tiny guard launch gpu]
    python benchmarks/offload.py --quick   # small sizes, 2 rounds: checks the script itself
"""

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torchmetrics
from _tables import add_docs_option, publish
from offload_parts.costs import guard, tiny
from offload_parts.gpu import gpu
from offload_parts.launch import LAUNCH_STEPS, launch
from offload_parts.report import Report, goals, table
from offload_parts.saves import LOOP_BATCH, LOOP_STEPS, LOOP_WIDTH, heavy, loop

from lightning_store import StoreOnCPUWarning
from lightning_store.metrics._offload.process.child import _keep_freed_memory

PARTS = ("heavy", "loop", "tiny", "guard", "launch", "gpu")


def run_parts(args: argparse.Namespace, report: Report) -> None:
    """Run the parts ``args`` name, in this process, into ``report``."""
    rounds = 2 if args.quick else max(args.rounds, 2)
    calls = 3 if args.quick else max(args.calls, 2)
    if "heavy" in args.parts:
        heavy(report, rounds, calls, (10_000, 100_000) if args.quick else (100_000, 1_000_000))
    if "loop" in args.parts:
        loop(report, rounds, *((5, 1024, 32) if args.quick else (LOOP_STEPS, LOOP_BATCH, LOOP_WIDTH)))
    if "tiny" in args.parts:
        tiny(report, rounds, 200 if args.quick else 2000)
    if "guard" in args.parts:
        guard(report, rounds, 3 if args.quick else 20)
    if "launch" in args.parts:
        launch(report, rounds, 10 if args.quick else LAUNCH_STEPS)
    if "gpu" in args.parts:
        if torch.cuda.is_available():
            gpu(report, rounds, args.quick, torch.device("cuda", torch.cuda.current_device()))
        else:
            print(f"GPU part skipped: torch.cuda.is_available() is False (torch {torch.__version__})")


def run_part_apart(args: argparse.Namespace, part: str, report: Report) -> None:
    """Run one part in a Python process of its own, into ``report``.

    A part's figures must not depend on the parts run before it. They did in one process: a part whose Metrics
    allocate large temporaries leaves glibc's heap with large free regions, and the first allocation of a few
    hundred bytes or more after a step of only small tensors then stalls for milliseconds, once in a while. A step
    with no Metric (the baseline of part 5) never makes one, and the offloaded steps beside it paid the stalls.
    Part 5's Metrics did the same to one another, and its ways: it runs each way of each Metric in a process of its
    own (the self-check's ``Way``, ``lightning_store/_selfcheck/_way.py``).
    """
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "report.pickle")
        command = [sys.executable, __file__, "--parts", part, "--rounds", str(args.rounds), "--calls", str(args.calls)]
        command += ["--threads", str(args.threads), "--report-to", path] + (["--quick"] if args.quick else [])
        subprocess.run(command, check=True)
        with open(path, "rb") as file:
            done = pickle.load(file)
    report.rows += done.rows
    report.notes += done.notes
    report.gpu_notes += done.gpu_notes
    report.mismatches += done.mismatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5, help="heavy Metric: update calls a round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, process-wide")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds: checks the script itself")
    parser.add_argument("--report-to", help=argparse.SUPPRESS)  # run the parts here, pickle what they measured there
    add_docs_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["HELD"] = os.path.join(tempfile.mkdtemp(), "held")  # before a worker process starts: it reads it
    warnings.filterwarnings("ignore", category=StoreOnCPUWarning)  # the tight loops here fall behind on purpose
    report = Report()
    if args.report_to:
        _keep_freed_memory()
        run_parts(args, report)
        with open(args.report_to, "wb") as file:
            pickle.dump(report, file)
        return
    rounds = 2 if args.quick else max(args.rounds, 2)
    started = time.perf_counter()
    print(
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, torchmetrics {torchmetrics.__version__},"
        f" {torch.get_num_threads()} intra-op thread(s); {rounds} rounds; `python {' '.join(sys.argv)}`\n"
    )
    for part in PARTS:
        if part in args.parts:
            run_part_apart(args, part, report)
    intro = [
        f"`benchmarks/offload.py`, {torch.get_num_threads()} torch thread(s), {rounds} rounds, each part (each way of"
        " each Metric of part 5) in a process of its own: each ratio is the offloaded time over the baseline's,"
        " measured side by side in each round; its median, and in brackets the interquartile range over the rounds.",
        "",
    ]
    gpu_rows = [row for row in report.rows if row.part == "6"]
    write = not (args.quick or args.no_docs)
    cpu_rows = [r for r in report.rows if r.part != "6"]
    publish("offload_cpu", intro + table(cpu_rows), report.notes, goals=goals(cpu_rows), write=write)
    if gpu_rows:
        publish("offload_gpu", intro + table(gpu_rows), report.gpu_notes, goals=goals(gpu_rows), write=write)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if report.mismatches:
        print(f"\n{len(report.mismatches)} VALUE MISMATCH(ES): see above", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
