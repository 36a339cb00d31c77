"""Tensor and expert parallelism over torch.distributed: `shard` (what each rank holds and the
model's collectives), `channel` (rank 0 sends each step's inputs to the workers), `launch`
(process start, the rank watchdog, loading one rank). See docs/parallel.md."""
