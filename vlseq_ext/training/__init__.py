"""The training engine: ParallelTrainer and its parts, and the one training loop."""
