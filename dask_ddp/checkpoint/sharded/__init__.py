"""Sharded checkpoints over torch DCP: each rank writes its own shards; FSDP2 and DDP models, resharded on load.

Runs in: the rank process (and one process exporting or inspecting a checkpoint). The calls a user makes
(:mod:`.api`: ``save_sharded``, ``load_sharded``, ``list_sharded``, ``wait_sharded``), the user's state as DCP
sees it (:mod:`.state`), saves in the background (:mod:`.background`), the folder of sharded checkpoints and
its commit (:mod:`.folder`), one file out of a sharded checkpoint (:mod:`.export`), and the storage layer under
DCP: the writer (:mod:`.writer`), the reader (:mod:`.reader`) and the non-tensor items read safely
(:mod:`.values`).
"""
