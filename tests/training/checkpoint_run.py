"""One RL-style run for the checkpoint tests, in its own process: train, generate (sampled), checkpoint.

``python checkpoint_run.py full DIR OUT``: 6 iterations, checkpoint after iteration 3, results to OUT.
``python checkpoint_run.py resume DIR OUT``: a fresh process loads DIR's latest checkpoint, runs iterations
4..6 and writes the same results, which must be bit-identical to the full run's.
"""

import sys

import torch

from hybrid_engine import initialize
from hybrid_engine.accelerator import CPUAccelerator, set_accelerator
from hybrid_engine.tiny_models import build_model

ITERATIONS, SAVE_AFTER = 6, 3


def main(mode: str, ckpt_dir: str, out: str) -> None:
    set_accelerator(CPUAccelerator())
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = build_model("tiny-gpt2", seed=5)  # GPT-2 has dropout: the training forward draws from the RNG
    engine, *_ = initialize(
        model=model,
        config={"optimizer": {"type": "AdamW", "params": {"lr": 5e-3}}, "gradient_accumulation_steps": 1,
                "hybrid_engine": {"enable_graph_capture": True}},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )
    prompts = torch.randint(4, 300, (3, 5), generator=torch.Generator().manual_seed(9))
    start = 0
    if mode == "resume":
        path, client = engine.load_checkpoint(ckpt_dir)
        assert path is not None and client == {"iteration": SAVE_AFTER}, (path, client)
        start = SAVE_AFTER
    tokens = []
    for it in range(start, ITERATIONS):
        engine.eval()
        seq = engine.generate(input_ids=prompts, max_new_tokens=8, do_sample=True, temperature=1.0)
        tokens.append(seq)
        engine.train()
        loss = engine(input_ids=seq, labels=seq).loss
        engine.backward(loss)
        engine.step()
        if mode == "full" and it + 1 == SAVE_AFTER:
            engine.save_checkpoint(ckpt_dir, client_state={"iteration": SAVE_AFTER})
    torch.save({"tokens": tokens[-(ITERATIONS - SAVE_AFTER):], "weights": model.state_dict(),
                "lr": engine.lr_scheduler.get_last_lr(), "steps": engine.global_steps,
                "captures": engine.graph_stats.captures}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
