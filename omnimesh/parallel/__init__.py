"""Parallelism inside a stage: process groups, pipeline partition, tensor-parallel layers, the rank executor.

    parallel_state.py  ParallelState (one per rank, passed explicitly), init_parallel_state, collectives
    partition.py       partition_layers: contiguous layer ranges per pipeline rank
    layers.py          column / row / QKV / merged linears, vocab-parallel embedding and head, MoE experts
    mp_executor.py     one stage's ranks as local processes, driven from the server

Nothing is imported here, so `import omnimesh.parallel.partition` stays cheap.
"""
