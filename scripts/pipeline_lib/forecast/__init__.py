"""Will a draft pay for this target? The speedup forecast (scripts/forecast_speedup.py).

vLLM serves the run's target (its own config and tokenizer; real or dummy weights) without a
draft and with the draft the run will train (its type, layers, draft vocabulary and k, weights
dummy), and with `rejection_sample_method: synthetic` the draft arm accepts, on average, a chosen
acceptance length tau: the real speculation machinery at a tau nobody has trained for yet.
GuideLLM measures each arm at several requests in flight, the way bench/speedup_curve.py
measures a trained draft. From the points: speedup against tau per concurrency, and the
break-even tau (where the draft starts to pay).

  server.py  `vllm serve` on 127.0.0.1 and its speculative-decoding counters
  load.py    one GuideLLM point (closed-loop streams) and the checks that keep a lying point out
  shapes.py  the draft config the run will train, written without weights; reference shapes
  curve.py   speedup per tau and concurrency, break-even, a measured tau placed on the curve
  schedule.py  the k per batch size vLLM should serve the draft with (from curves per k)
"""
