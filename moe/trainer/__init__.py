"""The trainer room: everything that turns MoE layers into a training run, built on `moe.layer` below it.

The model (`models/`), pipeline parallelism (`pipeline/`), the trainer itself (`train/`: config, parallel state,
optimizers, checkpoints, rewind, metrics, `Trainer`), training data (`data/`), the on-disk format (`io/`) and the
layout planner (`plan/`), and on top the run assembly (`run.py`: check -> build -> start -> fit -> report, what
train.py runs). Nothing in `moe.layer` imports from here.
"""
