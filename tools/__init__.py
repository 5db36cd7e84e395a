"""``resilient ckpt``: streaming checkpoint tools on top of the snapshot format.

Every tool works on any fsspec URL and reads tensors region by region through
:class:`resilient.snapshot.SnapshotReader`, so peak memory is a few row blocks,
never the model: they work on checkpoints larger than RAM.

Modules: :mod:`.cli` (argument parsing, ``main``), :mod:`.listing` (ls,
inspect), :mod:`.verify`, :mod:`.reshard` with :mod:`.layouts`,
:mod:`.convert` (export), :mod:`.importer`, :mod:`.diff`, :mod:`.gc`;
:mod:`.writer` writes new versions, :mod:`.blocks` cuts tensors into row blocks.
"""
