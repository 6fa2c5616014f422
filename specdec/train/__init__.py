"""Training draft heads for a target: prompts, self-distillation, training-time test, the trainer."""
