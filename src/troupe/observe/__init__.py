"""Looking inside a run: per-step stats, the Chrome timeline (`trace`), TensorBoard
scalars (`tensorboard`), and timing steps against each other in turns (`turns`: the A/B
engine the benchmarks and the partition planner's in-step calibration share). Observes;
never changes what is trained or sent."""
