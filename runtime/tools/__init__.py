"""Outside the training loop: the baselines canzona is measured against, the single-process
reference (the test oracle), kernel calibration, and describing a live model."""
