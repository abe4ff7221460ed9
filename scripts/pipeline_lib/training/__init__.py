"""train_draft.py's parts, one module per concern:

  settings.py     the `train` config section (TrainSettings) and what CPU training needs
  inputs.py       the inputs training reads, refused where they would make a wrong or useless
                  draft; the draft vocabulary maps (d2t/t2d) from the loss-token counts
  checkpoints.py  the epoch checkpoints dir: complete epochs, the trajectory fingerprint that
                  decides resume vs start over, the best epoch, pruning to keep_last
  trainer.py      speculators' trainer run in this process or as torchrun workers: its flags,
                  metric capture, the untrained baseline
  outputs.py      final/ and untrained/ (verifier path made relative), train_metrics.csv
  checkout.py     the checkout speculators runs from: recorded by commit and diff digest,
                  its diff never copied into checkpoints

The hidden states come through pipeline_lib.hidden_states.training (offline files or an online
vLLM server), the process launch through pipeline_lib.launch.
"""


def log(msg: str) -> None:
    print(f"[train_draft] {msg}", flush=True)
