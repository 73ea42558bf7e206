"""Pipeline parallelism: the model cut into stages, each stage's compiled step, its
messages, its variables and its saving."""
