"""Training loops of the user's own: the distributed dataset, gradient tape and
optimizer (``tnt.distribute_dataset``, ``tnt.DistributedGradientTape``,
``tnt.DistributedOptimizer``)."""
