"""Training: advantages, policy losses, tree batches, the trainer loop, checkpoints."""
