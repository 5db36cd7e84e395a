"""The run dir's control plane: who runs the embedded etcd of ``resilient launch``, and how the others find it.

``claim.py``: one owner per run dir, taken atomically (a ``flock`` held for the owner's life
and a record sealed with the job secret); ``plane.py``: the owner's etcd (client TLS and
authentication derived from the secret) and the others' join; ``api.py``: typed errors.
"""

from resilient.control.api import (ClaimElsewhere, ClaimError, ClaimForged, ClaimSettings, ClaimTimeout,
                                   OwnerRecord)

__all__ = ["ClaimElsewhere", "ClaimError", "ClaimForged", "ClaimSettings", "ClaimTimeout", "OwnerRecord"]
