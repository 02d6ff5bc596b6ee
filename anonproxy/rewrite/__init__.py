"""Statement classification and rewriting for anonymized roles.

``decide(sql, role, policy)`` returns what the proxy does with the text of a
Query or Parse message: :class:`Pass` (forward the original bytes),
:class:`Relayed` (run the given SQL, a rewrite of the client's, on its own connection),
:class:`Rewrite` (run the given SQL on the service connection),
:class:`Intercept` (``SHOW anonproxy.<setting>``, answered by the proxy) or
:class:`Reject` (an ErrorResponse). See docs/suppression.md.
"""

from anonproxy.rewrite.classify import decide
from anonproxy.rewrite.decision import Decision, Intercept, Noisy, Pass, Reject, Relayed, Rewrite

__all__ = ["Decision", "Intercept", "Noisy", "Pass", "Reject", "Relayed", "Rewrite", "decide"]
