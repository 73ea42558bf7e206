"""Pipeline parallelism: the model cut into stages, each stage's compiled step, its
messages, its variables and its saving."""

from . import model  # noqa: F401 (the strategy's model class registers with tnt.Model)
