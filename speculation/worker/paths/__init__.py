"""Verification paths for prod, behind one small interface.

A path turns (prompt token ids, max new tokens, K) into committed token batches, one batch per target
verification, and keeps SpecRunStats. `native` needs no worker (the gateway passes the request through, see
speculation.gateway.native); `remote` and `local` run in the GPU worker (speculation.worker.tasks).
"""

from speculation.worker.paths.base import CommittedBatch, SpecRunStats

__all__ = ["CommittedBatch", "SpecRunStats"]
