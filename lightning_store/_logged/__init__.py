"""What ``self.log(..., store_on_cpu=True)`` stores: the option's resolution, the Trainer's results, each result."""
