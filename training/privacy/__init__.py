"""Differential privacy per region: DP-SGD with Poisson sampling, per-sample clipping and
noise, and Opacus' RDP accountant; the budget stops the run. Imports training.comm,
training.data, training.errors and training.spec."""
