"""Several machines: sharding a target (tensor or pipeline parallel), the ranks of an
`mx.distributed` group, and what rank 0 decides for all."""
