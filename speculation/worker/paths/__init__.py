"""What the worker's prod paths need around the engine's decode loop (speculation.engine.decode.generate).

`remote`: RemoteTarget, the engine's Target over a server's scoring call; `stopping` / `text`: vLLM's stop rules
and incremental detokenizing, applied token by token; `resources`: the models, heads and tokenizers a worker
process keeps loaded; `drafting`: teacher-forced passes for the shadow measurement. The local path's target is
the engine's LocalTarget. `native` needs no worker (the gateway passes the request through, see
speculation.gateway.native). `base`: CommittedBatch, one step's committed tokens as the batch loop reports them
(speculation.worker.batching); the one loop's steps are counted by the engine's SpecStats.
"""

from speculation.worker.paths.base import CommittedBatch

__all__ = ["CommittedBatch"]
