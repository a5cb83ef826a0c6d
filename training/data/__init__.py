"""A region's training data, read only on the region's own hosts: the loader that draws
batches from it and its position, which checkpoints keep. Imports only training.errors and
training.spec."""
