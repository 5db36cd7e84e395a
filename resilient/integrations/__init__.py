"""Adapters that give a trainer people already run every tier and check of :class:`resilient.Job`.

Each adapter is an optional extra and imports its trainer; nothing in the
runtime imports this package (``resilient/`` core must run without them):

- :mod:`resilient.integrations.lightning`  PyTorch Lightning: ``ResilientCallback``
  (``pip install 'resilient[lightning]'``)
"""
