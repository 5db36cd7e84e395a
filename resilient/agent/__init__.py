"""The resilient agent: one per node, supervising that node's workers.

Built on ``torch.distributed.elastic``'s ``SimpleElasticAgent`` (rendezvous
rounds, rank assignment, restart accounting, scale-up on waiting nodes) with
what it lacks written here: warm worker processes instead of cold spawns
(:mod:`.pool`), heartbeats that catch hung workers (:mod:`.heartbeat`), a
liveness lease per node in etcd that turns a lost node into a restart within
seconds (:mod:`.membership`), and preemption handling (:mod:`.agent`).
"""
