"""Looking inside a run: per-step stats, the Chrome timeline (`trace`) and TensorBoard
scalars (`tensorboard`). Observes; never changes what is trained or sent."""
