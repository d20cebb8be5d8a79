"""nondet: find where run-to-run nondeterminism enters a deep-learning training job.

The two public functions are for scripts whose training step nondet cannot detect on its
own, or to mark a tensor of interest. Both do nothing when the script is not running under
``nondet run`` / ``nondet check``, so they can stay in the code.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "probe", "step"]


def step() -> None:
    """Mark the end of one training step (the boundary nondet uses to number steps).

    Once a script calls this, nondet stops detecting steps from optimizer updates and uses
    only these calls.
    """
    from nondet import session as session_module

    session = session_module.current()
    if session is not None:
        session.explicit_step()


def probe(tensor: Any, name: str) -> None:
    """Fingerprint ``tensor`` under ``name`` in the current step (shown in the report)."""
    from nondet import session as session_module

    session = session_module.current()
    if session is not None:
        # a name that is not text (a number, bytes) is shown as its str(), never refused
        session.probe(tensor, name if isinstance(name, str) else str(name))
