"""A Hugging Face Trainer script, unchanged from what torchrun runs: a tiny GPT-2 from a config, random tokens.

    dask-ddp run examples/trainers/transformers_tiny.py                      # 2 ranks on a local cluster
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/trainers/transformers_tiny.py   # the same line

Without ACCELERATE_USE_CPU=true (or TrainingArguments(use_cpu=True)), torchrun on CPUs trains each rank alone; a
dask-ddp rank gets it (docs/guide/trainers.md). Rank 0 prints one RESULT line.
"""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                   eos_token_id=0))
tokens = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=8, logging_steps=4,
                         save_strategy="no", report_to=[], seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
if trainer.is_world_process_zero():
    total = sum(p.double().sum().item() for p in model.parameters())
    print(f"RESULT transformers world={args.world_size} loss={trainer.state.log_history[-1]['train_loss']:.6f} "
          f"params={total:.9f}", flush=True)
