"""One module per pool kind behind one small protocol (`base.Backend`).

Components ask `backend_for(region)` (`registry.py`) and call its methods; they never
branch on a kind. The backend is chosen per region, so a stack may mix kinds where the
backends can work together (the model's checks reject the mixes that cannot, with the
reason).
"""

from infra.backends.base import Backend, BackendContext, Parent
from infra.backends.registry import backend_for, backends_of

__all__ = ["Backend", "BackendContext", "Parent", "backend_for", "backends_of"]
