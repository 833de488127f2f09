"""Tensor parallelism: the ranks of one server, each a process holding its share of the model
(`tandem.server.model.shard`) and of every KV page (its own KV heads).

Rank 0 is the server: gRPC, metrics, the scheduler, the KV connector and the only lm_head. It
decides every step alone and hands each forward pass's token batch to the other ranks
(`workers.RankPool`), which run the same layers over their heads and meet rank 0 in the
all-reduces (`group.ProcessGroup`). The other ranks run no scheduler at all: they cannot
disagree with rank 0 about what to run, and the scheduler never needs torch.

    group.py     the collectives (gloo on CPU, NCCL on CUDA: the one place that chooses), timeouts
    workers.py   RankPool (rank 0's handle: start, hand each forward pass out, watch, stop) and a
                 rank's main loop, which builds its share from rank 0's own EngineConfig and
                 DisaggConfig (RankSpec: the configs, the rendezvous port, the advertise host)
"""
