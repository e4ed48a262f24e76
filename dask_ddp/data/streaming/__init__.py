"""Streaming: samples packed in shards, read in a global order from any fsspec URL, resumable.

Runs in: the rank process and its DataLoader workers (``write_shards`` in the client and on the workers).
Shards written on the cluster (:mod:`.write`, in the format of :mod:`.format`, MDS and LitData shards read as
they are by :mod:`.foreign`), read by ``StreamingDataset`` (:mod:`.dataset`, fetching through :mod:`.fetch` and
the node cache :mod:`.cache`) and its ``StreamingLoader`` (:mod:`.loader`, in the order of :mod:`.order`),
whose positions ride in every checkpoint (:mod:`.state`). The public names are in :mod:`dask_ddp.data`.
"""
