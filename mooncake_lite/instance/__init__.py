"""What the two inference instances (prefill and decode) share, below both roles.

config.py   ModelRoleConfig: the flags of a model-running role (model, dtype, KV cache size, conductor)
runner.py   build_runner: the model (or a CPP layer slice of it) and its paged KV cache, as the flags say
tp_ranks.py a tensor-parallel instance's ranks: rank 0 starts, checks, watches and stops the others
profile.py  start-up self-profiling: time a few model runs, fit the scheduler's cost models
"""
