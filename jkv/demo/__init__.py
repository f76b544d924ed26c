"""jkv's demo: the task, its tokenizer, the trainer of the bundled demo model, and `make demo`.

  haystack.py   the task: 5-digit codes of named facts hidden in simple English filler
  tokenizer.py  the demo model's word-level tokenizer over the task's vocabulary
  train.py      trains the demo model (`python -m jkv.demo.train`, `make train-demo`)
  __main__.py   `make demo` (`python -m jkv.demo`): the bundled model answered under KV policies

The bundled model itself lives with the model definitions, in `models/demo/` (`jkv.load("demo")`).
Importing this package imports none of its modules.
"""
