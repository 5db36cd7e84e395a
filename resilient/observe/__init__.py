"""Observing a job from outside it: its status, its goodput, pictures. (Each agent's metrics are
:mod:`resilient.agent.metrics`.) Imports nothing: import the module you need."""
