"""Layer 4, method: weak-to-strong training with ANCHOR. Imports the data, model and evaluation layers only.

losses.py           the W2S, confidence and ANCHOR losses, the anchored layers
training.py         the one training loop (TrainConfig, train_reward_model): knows no tracker; Ray runs it per worker
reference_cache.py  the frozen reference's states, computed once (RAM, disk or live)
stages.py           the student a run starts from, the reference for training, training on pairs, soft labels
student.py          train_student: the one student run (train, validate each epoch, log through a MetricSink)
drift.py            drift from the pretrained representation, per trial on fixed pairs
lambda_scale.py     the search's lambda range, calibrated for the student
memory_plan.py      what a student's training needs in GPU memory, before it starts
"""
