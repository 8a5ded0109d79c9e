"""Fine-tuning: training data, loop and checkpoints."""
