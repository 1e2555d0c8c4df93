"""Graph backends: one interface, four choices (eager reference, inductor, torchair, auto)."""
from .base import Backend, BackendUnavailable, DynamicDims, ShapePolicy, compile_per_bucket
from .factory import get_backend, resolve_backend_name

__all__ = ["Backend", "BackendUnavailable", "DynamicDims", "ShapePolicy", "compile_per_bucket", "get_backend",
           "resolve_backend_name"]
