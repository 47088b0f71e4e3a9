"""Distributed simulation on ``torch.distributed``: a round's clients sharded over long-lived ranks (``torchrun``
or ``fedsight run --nproc N``), the server on rank 0, results identical to one process (docs/distributed.md).

* ``world``: the rank's place (torchrun's environment), the process group, the checks every rank agrees on;
* ``engine``: the cost split, rank 0's ``DistributedBackend`` and a worker's ``serve`` loop;
* ``run``: one run on every rank (``execute`` on rank 0, ``serve_run`` elsewhere);
* ``launch``: ``--nproc N`` starting the ranks through torchrun's elastic API.
"""

from .world import World, current

__all__ = ["World", "current"]
