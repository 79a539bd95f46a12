"""``offload_to_cpu``'s parts: the class in front of the Metric's own, its queue, and the two workers that run it."""
