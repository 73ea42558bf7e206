"""Data parallelism: the model class, its distributed step around Keras' own, and what
the step sums over ranks (gradients through ``tarantella.comm``, metric states,
loss normalisers, synchronized batch statistics)."""
