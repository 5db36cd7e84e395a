"""The operator's commands that are not a launch: ``resilient quarantine``, ``status``,
``store`` and ``doctor``, each a ``main(argv)`` that :mod:`resilient.cli` dispatches to.
Above the runtime they drive; nothing in the runtime imports them."""
