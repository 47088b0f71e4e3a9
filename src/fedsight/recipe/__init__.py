"""Recipe parts. Every part implements hooks of ``fedsight.training`` (DESIGN.md section 1)."""

from ..training import ClientContext, Component, ServerContext

__all__ = ["ClientContext", "Component", "ServerContext"]
