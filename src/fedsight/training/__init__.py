"""Training primitives below the recipe parts: hook contexts, the ``Component`` hooks and the local loop."""

from .component import Component, ExtrasSpec, OutputNoise, VectorStep
from .context import ClientContext, ClientState, EvalContext, ServerContext, UploadContext
from .local import SGD_TRAINER, LocalTraining, Trainer, train_client

__all__ = ["SGD_TRAINER", "ClientContext", "ClientState", "Component", "EvalContext", "ExtrasSpec", "LocalTraining",
           "OutputNoise", "ServerContext", "Trainer", "UploadContext", "VectorStep", "train_client"]
