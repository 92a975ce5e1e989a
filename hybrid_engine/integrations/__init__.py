"""Adapters for the trainers people already run: :mod:`.trl` (TRL's ``GRPOTrainer`` ``rollout_func``, PEFT
models included) and :mod:`.deepspeed` (DeepSpeed's rollout interface).

Nothing is imported here, so ``import hybrid_engine`` never pulls in trl, peft or deepspeed; import the
submodule you use (the optional extras ``hybrid-engine[trl]`` and ``hybrid-engine[deepspeed]`` install them).
"""
