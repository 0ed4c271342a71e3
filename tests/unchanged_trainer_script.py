"""A one-device script that trains through transformers' Trainer, as its documentation shows it, which
tests/test_unchanged.py runs under ``ddpkit run --unchanged`` on 2 processes: --unchanged stands aside before its first
line (the Trainer distributes itself), and the run finishes, its model saved.

    python tests/unchanged_trainer_script.py OUT
"""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out = sys.argv[1]
torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
tokens = torch.randint(1, 50, (52, 8))
train = [{"input_ids": row, "labels": row} for row in tokens[:48]]
evaluation = [{"input_ids": row, "labels": row} for row in tokens[48:]]
arguments = TrainingArguments(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=8, num_train_epochs=1,
                              learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                              use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=model, args=arguments, train_dataset=train, eval_dataset=evaluation)
trained = trainer.train()
metrics = trainer.evaluate()
trainer.save_model(os.path.join(out, "model"))
if trainer.is_world_process_zero():
    with open(os.path.join(out, "result.json"), "w") as file:
        json.dump({"steps": trained.global_step, "eval_loss": metrics["eval_loss"],
                   "saved": sorted(os.listdir(os.path.join(out, "model")))}, file)
