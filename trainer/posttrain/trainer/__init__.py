"""The JAX side of posttrain: models, data, training loop, checkpoints, export."""
