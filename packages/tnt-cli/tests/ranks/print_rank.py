"""Prints its rank once on stdout and once on stderr."""
import os
import sys

rank, size = os.environ["TNT_RANK"], os.environ["TNT_SIZE"]
print(f"rank {rank} of {size}", flush=True)
print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
