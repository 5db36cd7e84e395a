"""Observing a running job: metrics, status, goodput. Imports nothing: import the module you need."""
