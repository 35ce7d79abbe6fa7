"""Tensor parallelism over torch.distributed: Megatron-style sharding (:mod:`.shard`), one rank's
model (:mod:`.build`), the process group (:mod:`.comm`), the leader's runner (:mod:`.leader`) and
the follower ranks (:mod:`.follower`). With ``tensor_parallel_size == 1`` none of this is imported."""
