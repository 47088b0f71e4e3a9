"""Training primitives below the recipe parts: hook contexts, the ``Component`` hooks and the local loop."""

from .component import Component
from .context import ClientContext, ClientState, EvalContext, ServerContext
from .local import SGD_TRAINER, LocalTraining, Trainer, train_client

__all__ = ["SGD_TRAINER", "ClientContext", "ClientState", "Component", "EvalContext", "LocalTraining", "ServerContext",
           "Trainer", "train_client"]
