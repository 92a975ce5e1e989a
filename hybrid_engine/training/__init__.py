"""The training side: stage 0 in plain PyTorch (:mod:`.local`, :mod:`.precision`), ZeRO 1-3 on DeepSpeed
(:mod:`.deepspeed`), DeepSpeed's engine queries (:mod:`.deepspeed_interface`) and checkpoints."""
