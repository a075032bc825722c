"""Distinct types for the identities that travel between processes.

``NewType`` costs nothing at run time but lets a type checker catch a worker id passed
where a tenant id belongs.
"""

from typing import NewType

#: 128-bit chained block hash, as 32 lowercase hex characters.
BlockHash = NewType("BlockHash", str)
#: Hash of (model id, weights digest, cache format version, kernel ABI), 32 hex characters.
Namespace = NewType("Namespace", str)
WorkerId = NewType("WorkerId", str)
TenantId = NewType("TenantId", str)
LeaseId = NewType("LeaseId", str)
#: A worker's registration number; a restarted worker gets a higher one.
Epoch = NewType("Epoch", int)
#: Per-(worker, epoch) sequence number of a published transition, starting at 1.
Seq = NewType("Seq", int)
#: Per-slot replica generation: the fencing token a read lease carries.
Generation = NewType("Generation", int)

#: Hash of the empty prefix: the parent of the first block of every sequence.
ROOT_HASH: BlockHash = BlockHash("0" * 32)
