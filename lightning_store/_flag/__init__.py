"""The deprecated ``Trainer(move_metrics_to_cpu=True)``: the argument, its hooks, where LightningCLI took it."""
